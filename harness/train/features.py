"""What a training step does between zeroed gradients and the optimizer step, per feature
(harness.core.scenario.FEATURES). The sharded run and the plain reference run the same function,
so a feature is an equivalence like the plain step: same micro-batches, same scaling, same order.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.core.scenario import FEATURES, passes_per_step, reductions_per_step


def checkpoint_units(units: list[torch.nn.Module]) -> None:
    """Activation checkpointing on every unit (feature ac): its forward keeps no activations and runs
    again in backward (torch.utils.checkpoint, non-reentrant). Applied to the plain model before any
    implementation wraps it, inside the module call, so the implementation's hooks stay outside: its
    parameters are gathered for the recomputation by its own pre-backward hook, as for a checkpoint
    wrapper under FSDP2."""
    from torch.utils.checkpoint import checkpoint

    for unit in units:
        forward = unit.forward

        def checkpointed(*args, forward=forward, **kwargs):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        unit.forward = checkpointed


def micro_batches(x: torch.Tensor, y: torch.Tensor, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rank's batch in `k` contiguous, equal micro-batches (views: no copy)."""
    if k == 1:
        return [(x, y)]
    n = x.shape[0]
    if n % k:
        raise ValueError(f"a local batch of {n} samples does not split into {k} equal micro-batches")
    m = n // k
    return [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(k)]


def forward_backward(feature: str, spec, model, x: torch.Tensor, y: torch.Tensor,
                     mark: Callable = lambda phase, value=None: value,
                     set_sync: Callable[[bool], None] | None = None) -> torch.Tensor:
    """Forward and backward of one step on this rank's batch; returns the loss of the whole local batch
    (detached). `mark(phase, value)` is told where the step is (harness.measure.timeline);
    `set_sync(enabled)` switches the gradient reduction (the adapter's set_gradient_sync)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r}; features: {', '.join(FEATURES)}")
    k = passes_per_step(feature)  # clipping and checkpointing act outside this: one pass, as plain
    switched = reductions_per_step(feature) < k  # the reduction runs on the last pass only
    if switched and set_sync is None:
        raise ValueError(f"feature {feature!r} needs set_sync (the adapter's set_gradient_sync)")
    total = None
    for i, (xm, ym) in enumerate(micro_batches(x, y, k)):
        if switched:
            set_sync(i == k - 1)
        mark("forward")
        loss = spec.loss(mark("after_forward", model(xm)), ym)
        if k > 1:
            loss = loss / k
        mark("backward")
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total
