"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on a mesh made from the given group."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.adapters.base import Adapter, cpu_fp32, torch_clip
from harness.adapters.dtensor_gather import full_tensors


class TorchFSDP2Adapter(Adapter):
    """``reduce_dtype=None``: gradients are reduce-scattered in fp32 (FSDP2's default policy);
    ``torch.float64`` sums in double, which makes equal summands exact at W <= 8."""

    def __init__(self, reduce_dtype: torch.dtype | None = None) -> None:
        self.reduce_dtype = reduce_dtype
        self.name = "torch_fsdp2" if reduce_dtype is None else f"torch_fsdp2_{_short(reduce_dtype)}reduce"

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        return self._shard(model, units, mesh, group, device, param_dtype=None, reduce_dtype=self.reduce_dtype)

    def wrap_mixed_precision(
        self, model: nn.Module, units: list[nn.Module], *, group, device, param_dtype, reduce_dtype
    ) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        return self._shard(model, units, mesh, group, device, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def wrap_hybrid(
        self, model: nn.Module, units: list[nn.Module], *, group, device, shard_group, replicate_group
    ) -> nn.Module:
        """A 2D (replicate, shard) mesh from the harness's groups: FSDP2 shards over the last dimension,
        all-reduces across the first (HSDP)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        size = dist.get_world_size(group)
        ranks = torch.tensor([dist.get_global_rank(group, i) for i in range(size)])
        mesh = DeviceMesh.from_group(
            [replicate_group, shard_group],
            torch.device(device).type,
            mesh=ranks.view(dist.get_world_size(replicate_group), -1),
            mesh_dim_names=("replicate", "shard"),
        )
        return self._shard(model, units, mesh, group, device, param_dtype=None, reduce_dtype=self.reduce_dtype)

    def wrap_reshard_after_forward(
        self, model: nn.Module, units: list[nn.Module], *, group, device, reshard_after_forward: int
    ) -> nn.Module:
        """FSDP2's integer reshard_after_forward, given to every unit and the root (explicitly: the root too
        is resharded to the smaller group); the group's size as True, 1 as False (FSDP2 warns on the int 1)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        g = reshard_after_forward
        g = True if g == dist.get_world_size(group) else False if g == 1 else g
        return self._shard(
            model, units, mesh, group, device, param_dtype=None, reduce_dtype=self.reduce_dtype, reshard_after_forward=g
        )

    def wrap_shard_placement(
        self, model: nn.Module, units: list[nn.Module], *, group, device, shard_placement_fn
    ) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        return self._shard(
            model,
            units,
            mesh,
            group,
            device,
            param_dtype=None,
            reduce_dtype=self.reduce_dtype,
            shard_placement_fn=shard_placement_fn,
        )

    def wrap_offload(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import CPUOffloadPolicy

        mesh = DeviceMesh.from_group(group, torch.device(device).type)
        policy = CPUOffloadPolicy(pin_memory=torch.device(device).type == "cuda")  # pinning needs CUDA
        return self._shard(
            model, units, mesh, group, device, param_dtype=None, reduce_dtype=self.reduce_dtype, offload_policy=policy
        )

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

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        return {name: cpu_fp32(t) for name, t in full_tensors(list(wrapped.named_parameters())).items()}


def _short(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
