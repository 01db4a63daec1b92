"""The plain model, unwrapped: the trajectory every other adapter is compared with."""

from __future__ import annotations

from torch import Tensor, nn

from harness.adapters.base import Adapter, cpu_fp32, torch_clip


class ReferenceAdapter(Adapter):
    name = "reference"
    sharded = False

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        return model.to(device)

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        return None  # one process: nothing to reduce

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        return torch_clip(wrapped.parameters(), max_norm, norm_type)

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        return {name: cpu_fp32(p) for name, p in wrapped.named_parameters()}
