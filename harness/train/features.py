"""What a training step does between zeroed gradients and the optimizer step, per feature
(harness.core.scenario.FEATURES). The sharded run and the plain reference run the same function,
so a feature is an equivalence like the plain step: same micro-batches, same scaling, same order.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.core.scenario import FEATURES, hsdp_mesh, passes_per_step, reductions_per_step

# bf16: the dtypes of the mixed-precision policy every implementation (and the plain reference) is given
BF16_POLICY = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def wrap_for(feature: str, adapter, model, units, *, group, device):
    """The adapter's wrap for the feature: under a mixed-precision policy (bf16), on a hybrid mesh
    (hsdp), else plain ``wrap``."""
    if feature == "bf16":
        return adapter.wrap_mixed_precision(model, units, group=group, device=device, **BF16_POLICY)
    if feature == "hsdp":
        shard_group, replicate_group = hybrid_groups(group)
        return adapter.wrap_hybrid(model, units, group=group, device=device, shard_group=shard_group,
                                   replicate_group=replicate_group)
    return adapter.wrap(model, units, group=group, device=device)


_HYBRID: dict[tuple, tuple] = {}  # (group ranks, backend) -> this rank's (shard group, replicate group)


def hybrid_groups(group):
    """This rank's shard group and replicate group of the hybrid mesh over `group` (harness.core.scenario.
    hsdp_mesh: rank = replica x shard size + index in its shard group). Made once per world and kept:
    only the member ranks of each new group take part in making it (use_local_synchronization), so it
    works as well inside a torchrun job whose other ranks sit this world size out."""
    import torch.distributed as dist

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ranks = [dist.get_global_rank(group, i) for i in range(size)]
    key = (tuple(ranks), dist.get_backend(group))
    if key not in _HYBRID:
        replicas, shard = hsdp_mesh(size)
        replica, index = divmod(rank, shard)
        shard_ranks = ranks[replica * shard:(replica + 1) * shard]
        replicate_ranks = ranks[index::shard]
        _HYBRID[key] = tuple(dist.new_group(r, use_local_synchronization=True)
                             for r in (shard_ranks, replicate_ranks))
    return _HYBRID[key]


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
        out = mark("after_forward", model(xm))
        loss = spec.loss(out.float() if feature == "bf16" else out, ym)  # the loss in fp32, as plain
        if k > 1:
            loss = loss / k
        mark("backward")
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total
