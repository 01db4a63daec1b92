"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on a mesh made from the given group."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.adapters.base import PLAIN_WRAP, Adapter, WrapOptions, cpu_fp32, torch_clip
from harness.adapters.dtensor_gather import full_tensors


class TorchFSDP2Adapter(Adapter):
    """``reduce_dtype=None``: gradients are reduce-scattered in fp32 (FSDP2's default policy);
    ``torch.float64`` sums in double, which makes equal summands exact at W <= 8."""

    def __init__(self, reduce_dtype: torch.dtype | None = None) -> None:
        self.reduce_dtype = reduce_dtype
        self.name = "torch_fsdp2" if reduce_dtype is None else f"torch_fsdp2_{_short(reduce_dtype)}reduce"

    wrap_settings = frozenset({"mixed_precision", "hybrid", "reshard_after_forward", "shard_placement", "offload"})

    def wrap(
        self, model: nn.Module, units: list[nn.Module], *, group, device, options: WrapOptions = PLAIN_WRAP
    ) -> nn.Module:
        """fully_shard on every unit and the root, every setting at once: a mixed-precision policy (the adapter's
        own reduce dtype where the options name none), a 2-D (replicate, shard) mesh made from the harness's
        groups for HSDP (FSDP2 shards over the last dimension, all-reduces across the first), an integer
        reshard_after_forward given to every unit and the root (explicitly: the root too is resharded to the
        smaller group; the shard group's size as True, 1 as False: FSDP2 warns on the int 1), a shard placement,
        a CPU offload policy (pinned memory only where CUDA is)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        kind = torch.device(device).type
        if options.replicate_group is not None:
            size = dist.get_world_size(group)
            ranks = torch.tensor([dist.get_global_rank(group, i) for i in range(size)])
            mesh = DeviceMesh.from_group(
                [options.replicate_group, options.shard_group],
                kind,
                mesh=ranks.view(dist.get_world_size(options.replicate_group), -1),
                mesh_dim_names=("replicate", "shard"),
            )
            shard_ranks = dist.get_world_size(options.shard_group)
        else:
            mesh, shard_ranks = DeviceMesh.from_group(group, kind), dist.get_world_size(group)
        g = options.reshard_after_forward
        g = None if g is True else True if g == shard_ranks else False if g == 1 else g
        return self._shard(
            model,
            units,
            mesh,
            group,
            device,
            param_dtype=options.param_dtype,
            reduce_dtype=options.reduce_dtype if options.settings & {"mixed_precision"} else self.reduce_dtype,
            reshard_after_forward=g,
            shard_placement_fn=options.shard_placement_fn,
            offload_policy=CPUOffloadPolicy(pin_memory=kind == "cuda") if options.offload else None,
        )

    def refuses(self, feature: str) -> str | None:
        """FSDP2 cannot reshard a Shard(1) placement to a smaller group after forward: its post-forward mesh
        assumes dim 0 (an IndexError in backward, torch 2.13)."""
        from harness.core.features import has

        if has(feature, "reshard2") and has(feature, "shard1"):
            return "an integer reshard_after_forward with a Shard(1) placement: its post-forward mesh assumes dim 0"
        return None

    def _shard(
        self,
        model,
        units,
        mesh,
        group,
        device,
        *,
        param_dtype,
        reduce_dtype,
        reshard_after_forward=None,
        shard_placement_fn=None,
        offload_policy=None,
    ) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        options = {
            "mesh": mesh,
            "mp_policy": policy,
            "reshard_after_forward": reshard_after_forward,
            "shard_placement_fn": shard_placement_fn,
            "offload_policy": offload_policy or OffloadPolicy(),
        }
        model.to(torch.device(device))
        for unit in units:
            fully_shard(unit, **options)
        wrapped = fully_shard(model, **options)
        wrapped._harness_group = group  # the group a checkpoint is saved and loaded over
        return wrapped

    def save_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        """torch.distributed.checkpoint: each rank writes its DTensor shards; resharded on load."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(wrapped, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), process_group=wrapped._harness_group)

    def load_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(wrapped, optimizer)  # this world's layout to load into
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path), process_group=wrapped._harness_group)
        set_state_dict(wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        wrapped.set_requires_gradient_sync(enabled)  # every FSDP module under the root

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        return torch_clip(wrapped.parameters(), max_norm, norm_type)  # DTensor gradients: the global norm

    def full_params(self, wrapped: nn.Module, *, rank0_only: bool = False) -> dict[str, Tensor]:
        named = list(wrapped.named_parameters())
        return {name: cpu_fp32(t) for name, t in full_tensors(named, rank0_only=rank0_only).items()}


def _short(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
