"""Our own from-scratch ZeRO-3 (``fsdp_impl``), imported lazily so the harness loads without it."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from harness.adapters.base import PLAIN_WRAP, Adapter, AdapterError, WrapOptions, cpu_fp32


class FsdpImplAdapter(Adapter):
    name = "fsdp_impl"
    batch_invariant = True  # fsdp_impl.invariant_forward_backward

    wrap_settings = frozenset({"mixed_precision", "hybrid", "reshard_after_forward", "shard_placement", "offload"})

    def wrap(
        self, model: nn.Module, units: list[nn.Module], *, group, device, options: WrapOptions = PLAIN_WRAP
    ) -> nn.Module:
        """fsdp_impl.fully_shard on every unit, then the root, with every setting at once."""
        kw = {"process_group": group}
        if options.param_dtype is not None or options.reduce_dtype is not None:
            from fsdp_impl import MixedPrecisionPolicy

            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype)
        if options.replicate_group is not None:
            kw |= {"process_group": options.shard_group, "replicate_group": options.replicate_group}
        if options.reshard_after_forward is not True:
            kw["reshard_after_forward"] = options.reshard_after_forward
        if options.shard_placement_fn is not None:
            kw["shard_placement_fn"] = options.shard_placement_fn
        if options.offload:
            from fsdp_impl import CPUOffloadPolicy

            kw["offload_policy"] = CPUOffloadPolicy()
        return self._shard(model, units, device, **kw)

    def invariant_forward_backward(
        self, wrapped: nn.Module, loss_fn, inputs, targets, *, micro_batches: int, replicated: bool
    ):
        from fsdp_impl import invariant_forward_backward

        return invariant_forward_backward(
            wrapped, loss_fn, inputs, targets, micro_batches=micro_batches, replicated=replicated
        )

    def save_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        from fsdp_impl import save_sharded

        save_sharded(wrapped, optimizer, path)

    def load_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        from fsdp_impl import load_sharded

        load_sharded(wrapped, optimizer, path)

    def _shard(self, model: nn.Module, units: list[nn.Module], device, **options) -> nn.Module:
        try:
            from fsdp_impl import fully_shard
        except ImportError as exc:
            raise AdapterError(
                f"adapter 'fsdp_impl': cannot import fsdp_impl.fully_shard: {type(exc).__name__}: {exc}"
            ) from exc
        model.to(device)
        for unit in units:
            fully_shard(unit, **options)
        return fully_shard(model, **options)

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        from fsdp_impl import set_requires_gradient_sync

        set_requires_gradient_sync(wrapped, enabled)

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        from fsdp_impl import clip_grad_norm_

        return float(clip_grad_norm_(wrapped, max_norm, norm_type))

    def full_params(self, wrapped: nn.Module, *, rank0_only: bool = False) -> dict[str, Tensor]:
        from fsdp_impl import full_state_dict

        full = full_state_dict(wrapped, rank0_only=rank0_only)
        return {name: cpu_fp32(t) for name, t in full.items()} if not rank0_only or dist.get_rank() == 0 else {}
