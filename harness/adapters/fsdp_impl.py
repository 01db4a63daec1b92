"""Our own from-scratch ZeRO-3 (``fsdp_impl``), imported lazily so the harness loads without it."""

from __future__ import annotations

from torch import Tensor, nn

from harness.adapters.base import Adapter, AdapterError, cpu_fp32


class FsdpImplAdapter(Adapter):
    name = "fsdp_impl"
    batch_invariant = True  # fsdp_impl.invariant_forward_backward

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        return self._shard(model, units, device, process_group=group)

    def wrap_mixed_precision(
        self, model: nn.Module, units: list[nn.Module], *, group, device, param_dtype, reduce_dtype
    ) -> nn.Module:
        from fsdp_impl import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        return self._shard(model, units, device, process_group=group, mp_policy=policy)

    def wrap_hybrid(
        self, model: nn.Module, units: list[nn.Module], *, group, device, shard_group, replicate_group
    ) -> nn.Module:
        return self._shard(model, units, device, process_group=shard_group, replicate_group=replicate_group)

    def wrap_reshard_after_forward(
        self, model: nn.Module, units: list[nn.Module], *, group, device, reshard_after_forward: int
    ) -> nn.Module:
        return self._shard(model, units, device, process_group=group, reshard_after_forward=reshard_after_forward)

    def wrap_shard_placement(
        self, model: nn.Module, units: list[nn.Module], *, group, device, shard_placement_fn
    ) -> nn.Module:
        return self._shard(model, units, device, process_group=group, shard_placement_fn=shard_placement_fn)

    def wrap_offload(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from fsdp_impl import CPUOffloadPolicy

        return self._shard(model, units, device, process_group=group, offload_policy=CPUOffloadPolicy())

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

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        from fsdp_impl import full_state_dict

        return {name: cpu_fp32(t) for name, t in full_state_dict(wrapped).items()}
