"""The plain model, unwrapped: the trajectory every other adapter is compared with."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from harness.adapters.base import PLAIN_WRAP, Adapter, WrapOptions, cpu_fp32, torch_clip


class ReferenceAdapter(Adapter):
    name = "reference"
    sharded = False

    wrap_settings = frozenset({"mixed_precision", "offload"})  # the others change no number: not asked of it

    def wrap(
        self, model: nn.Module, units: list[nn.Module], *, group, device, options: WrapOptions = PLAIN_WRAP
    ) -> nn.Module:
        """The plain model; under a mixed-precision policy on param_dtype copies per forward (one process:
        nothing is reduced), with its state in host memory under offload, or both."""
        device = torch.device(device)
        module = model.to("cpu" if options.offload else device)
        if options.offload:
            module = Offloaded(module, device)
        if options.param_dtype is not None:
            module = MixedPrecision(module, options.param_dtype)
        return module

    def invariant_forward_backward(
        self, wrapped: nn.Module, loss_fn, inputs, targets, *, micro_batches: int, replicated: bool = True
    ):
        """The plain model's step summing `micro_batches` equal micro-batches of the (whole) batch in the fixed
        binary tree: each loss / L, every parameter's L gradients and the L losses added as left half + right
        half, recursively (the batch-invariant tier's yardstick, written apart from any implementation's)."""
        size = inputs.shape[0] // micro_batches
        params = [q for q in wrapped.parameters() if q.requires_grad]
        grads: list[list] = [[] for _ in params]
        losses = []
        for i in range(micro_batches):
            sl = slice(i * size, (i + 1) * size)
            loss = loss_fn(wrapped(inputs[sl]), targets[sl]) / micro_batches
            loss.backward()
            losses.append(loss.detach())
            for q, gs in zip(params, grads):
                gs.append(q.grad)
                q.grad = None
        for q, gs in zip(params, grads):
            q.grad = tree_sum(gs)
        return tree_sum(losses)

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        return None  # one process: nothing to reduce

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        return torch_clip(wrapped.parameters(), max_norm, norm_type)

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        while isinstance(wrapped, (MixedPrecision, Offloaded)):
            wrapped = wrapped.module
        return {name: cpu_fp32(p) for name, p in wrapped.named_parameters()}


class MixedPrecision(nn.Module):
    """The plain model under a mixed-precision policy, written out: every forward runs on
    `param_dtype` copies of the fp32 parameters (made once per forward; a tied parameter once), with
    floating inputs cast to `param_dtype`. Autograd casts each copy's gradient back to fp32 onto the
    master parameter, which the optimizer steps: what a sharded implementation under the same policy
    does at one rank, with no sharding code in the way."""

    def __init__(self, module: nn.Module, param_dtype: torch.dtype):
        super().__init__()
        self.module, self.param_dtype = module, param_dtype

    def forward(self, *args, **kwargs):
        low = {name: p.to(self.param_dtype) for name, p in self.module.named_parameters()}
        args, kwargs = tree_map(self._cast, (args, kwargs))
        return torch.func.functional_call(self.module, low, args, kwargs, tie_weights=True, strict=False)

    def _cast(self, x):
        if isinstance(x, Tensor) and x.is_floating_point():
            return x.to(self.param_dtype)
        return x


class Offloaded(nn.Module):
    """The plain model with its state in host memory, written out: the fp32 parameters (which the optimizer
    steps, so on the CPU) and their gradients live on the CPU; every forward runs on `device` copies of them
    (made once per forward; a tied parameter once), and autograd copies each copy's gradient back onto its
    CPU parameter. What a sharded implementation under a CPU offload policy does at one rank, with no
    sharding code in the way. Buffers live on `device`, where the forward uses and updates them."""

    def __init__(self, module: nn.Module, device: torch.device):
        super().__init__()
        self.module, self.device = module, device
        for sub in module.modules():
            for name, b in sub._buffers.items():
                if b is not None:
                    sub._buffers[name] = b.to(device)

    def forward(self, *args, **kwargs):
        on_device = {name: p.to(self.device) for name, p in self.module.named_parameters()}
        return torch.func.functional_call(self.module, on_device, args, kwargs, tie_weights=True, strict=False)


def tree_sum(xs: list):
    """xs summed as a complete binary tree over their index (None: a zero)."""
    if len(xs) == 1:
        return xs[0]
    half = len(xs) // 2
    left, right = tree_sum(xs[:half]), tree_sum(xs[half:])
    return left if right is None else right if left is None else left + right
