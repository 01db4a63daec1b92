"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on a mesh made from the given group."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.adapters.base import Adapter, cpu_fp32, torch_clip


class TorchFSDP2Adapter(Adapter):
    """``reduce_dtype=None``: gradients are reduce-scattered in fp32 (FSDP2's default policy);
    ``torch.float64`` sums in double, which makes equal summands exact at W <= 8."""

    def __init__(self, reduce_dtype: torch.dtype | None = None) -> None:
        self.reduce_dtype = reduce_dtype
        self.name = "torch_fsdp2" if reduce_dtype is None else f"torch_fsdp2_{_short(reduce_dtype)}reduce"

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device = torch.device(device)
        mesh = DeviceMesh.from_group(group, device.type)
        policy = MixedPrecisionPolicy(reduce_dtype=self.reduce_dtype)
        model.to(device)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        wrapped.set_requires_gradient_sync(enabled)  # every FSDP module under the root

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        return torch_clip(wrapped.parameters(), max_norm, norm_type)  # DTensor gradients: the global norm

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        return {
            name: cpu_fp32(p.full_tensor() if isinstance(p, DTensor) else p)
            for name, p in wrapped.named_parameters()
        }


def _short(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
