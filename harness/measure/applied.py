"""The gradients an optimizer applies: read at the moment its step begins, by a pre-step hook on every torch
optimizer the scenario made (harness.measure.census finds those an implementation keeps inside its own).

For an implementation that drives its own step (an engine: harness.adapters.base's hooks), this is where the
harness sees the reduced gradient at all: between the backward and the step the engine keeps it in buffers of
its own, partitioned, not in ``.grad``; at the optimizer's step it has reduced it (and clipped it, where the step
clips) onto the parameters the optimizer updates. An engine may step its optimizer more than once per step (one
call per group of partitions): every call's gradients are kept."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from harness.measure.memory import local_tensor


class AppliedGradients:
    def __init__(self, optimizers: list) -> None:
        self.sq, self.amax, self.values = 0.0, 0.0, []
        self._handles = [
            o.register_step_pre_hook(self._read)
            for o in optimizers
            if isinstance(o, torch.optim.Optimizer)  # an engine's own wrapper may not be one: what it wraps is
        ]

    def _read(self, optimizer, args, kwargs) -> None:
        # the harness's own reads: no tracker of the step (its peak, the localiser's ops) is to see them
        with _disable_current_modes():
            self._read_grads(optimizer)

    def _read_grads(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = local_tensor(p.grad).detach()
                self.sq += float(g.double().pow(2).sum())
                self.amax = max(self.amax, float(g.abs().max())) if g.numel() else self.amax
                self.values.append(g.reshape(-1).to("cpu", torch.float32, copy=True))

    def take(self) -> tuple[float, float, torch.Tensor]:
        """(this rank's squared norm of what its optimizers applied since the last take, the largest |element|,
        those values flat: copies the harness holds, to leave out of what the rank is measured to hold)."""
        with _disable_current_modes():  # a copy of the harness's, as the reads are
            out = (self.sq, self.amax, torch.cat(self.values) if self.values else torch.zeros(0))
        self.sq, self.amax, self.values = 0.0, 0.0, []
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
