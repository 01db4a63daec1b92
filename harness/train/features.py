"""What a training step does between zeroed gradients and the optimizer step, per feature
(harness.core.features.FEATURES). The sharded run and the plain reference run the same function,
so a feature is an equivalence like the plain step: same micro-batches, same scaling, same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.adapters.base import WrapOptions, call_wrap
from harness.core.features import (
    check_feature,
    clip_of,
    has,
    hsdp_mesh,
    passes_per_step,
    post_forward_ranks,
    reductions_per_step,
)
from harness.train.data import local_slice

# bf16: the dtypes of the mixed-precision policy every implementation (and the plain reference) is given
BF16_POLICY = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def wrap_options(feature: str, *, ctx) -> WrapOptions:
    """Every wrap setting the (composed) feature asks for, at once: a mixed-precision policy (bf16), a hybrid mesh
    (hsdp), resharding to a smaller group after forward (reshard2), a placement of its own (shard1), the state
    in host memory (offload); and, for an implementation that drives its own step, the micro-batches of one
    optimizer step and the clipping. `ctx`: the rank's RankContext (harness.execute.worker)."""
    # an engine accumulates the micro-batches whose gradients it reduces (accum); with the reduction switched off
    # between them (no_sync) the harness accumulates, and the engine steps once
    kw = {"micro_batches": reductions_per_step(feature), "clip": clip_of(feature)}
    if has(feature, "bf16"):
        kw |= BF16_POLICY
    if has(feature, "hsdp"):
        kw["shard_group"], kw["replicate_group"] = ctx.hybrid or hybrid_groups(ctx.group)
    shard_ranks = _size(kw.get("shard_group") or ctx.group)
    if has(feature, "shard1"):
        kw["shard_placement_fn"] = dim1_placement(shard_ranks)
    if has(feature, "reshard2"):
        kw["reshard_after_forward"] = post_forward_ranks(feature, ctx.world_size)
    if has(feature, "offload"):
        kw["offload"] = True
    return WrapOptions(**kw)


def wrap_for(feature: str, adapter, model, units, *, ctx):
    """The adapter's wrap with every setting the feature asks for (harness.adapters.base.call_wrap: the one
    composable wrap, or a deprecated one-setting wrap)."""
    return call_wrap(adapter, model, units, group=ctx.group, device=ctx.device, options=wrap_options(feature, ctx=ctx))


def dim1_placement(shard_ranks: int):
    """Feature shard1's placement: ``Shard(1)`` for a parameter of two or more dims whose dim 1 divides evenly
    over `shard_ranks` (as FSDP2 requires of a dim other than 0), None (Shard(0)) for any other."""
    from torch.distributed.tensor import Shard

    def placement(param):
        return Shard(1) if param.dim() >= 2 and param.shape[1] % shard_ranks == 0 else None

    return placement


def _size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group)


def hybrid_layout(world_size: int) -> list[list[int]]:
    """Every group of the hybrid mesh over ranks 0..W-1 (harness.core.features.hsdp_mesh: rank =
    replica x shard size + index in its shard group): the shard groups, then the replicate groups."""
    replicas, shard = hsdp_mesh(world_size)
    return [list(range(r * shard, (r + 1) * shard)) for r in range(replicas)] + [
        list(range(i, world_size, shard)) for i in range(shard)
    ]


def make_hybrid_groups(ranks: list[int], rank: int, new_group) -> tuple | None:
    """Make every group of the hybrid mesh over `ranks` (the global ranks of a world, in its order) with
    `new_group(global ranks)`, and return this rank's (shard group, replicate group). Every process
    that `new_group` needs calls this, in the same order (torch names a group by a count of the groups
    made before it, so ranks that make groups apart from each other do not find each other)."""
    made = [new_group([ranks[i] for i in members]) for members in hybrid_layout(len(ranks))]
    if rank >= len(ranks):  # a torchrun rank that sits this world size out: it only helped make them
        return None
    replicas, shard = hsdp_mesh(len(ranks))
    replica, index = divmod(rank, shard)
    return made[replica], made[replicas + index]


_HYBRID: dict[tuple, tuple] = {}  # (world ranks, backend) -> this rank's (shard group, replicate group)


def hybrid_groups(group):
    """This rank's hybrid groups in a world whose processes all run the scenario (a forkserver world:
    `group` is its WORLD), made once and kept. A torchrun job makes them itself (every rank of the
    job must take part) and hands them over in the RankContext."""
    import torch.distributed as dist

    ranks = [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]
    key = (tuple(ranks), dist.get_backend(group))
    if key not in _HYBRID:
        _HYBRID[key] = make_hybrid_groups(ranks, dist.get_rank(group), lambda members: dist.new_group(members))
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
    return [(x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]) for i in range(k)]


def rank_slices(x: torch.Tensor, y: torch.Tensor, ranks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch as the `ranks` ranks of a split run take it (harness.train.data.local_slice):
    micro-batch r is rank r's slice, in rank order."""
    return [local_slice(x, y, r, ranks, "split")[:2] for r in range(ranks)]


def forward_backward(
    feature: str,
    spec,
    model,
    x: torch.Tensor,
    y: torch.Tensor,
    mark: Callable = lambda phase, value=None: value,
    set_sync: Callable[[bool], None] | None = None,
    micro: int = 1,
    reverse: bool = False,
    slices_summed: bool = False,
    backward: Callable[[torch.Tensor], None] | None = None,
    micro_step: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward and backward of one step on this rank's batch; returns the loss of the whole local batch
    (detached). `mark(phase, value)` is told where the step is (harness.measure.timeline);
    `set_sync(enabled)` switches the gradient reduction (the adapter's set_gradient_sync). `micro` > 1
    (a reference's Scenario.micro_batches): the batch in the slices `micro` split ranks would take, each
    cut into the feature's own micro-batches as such a rank cuts it, a forward and backward each, every
    loss scaled by 1 / (their count), the gradients summed by autograd; `reverse`: the slices in reverse
    rank order (a noise probe's other order of summation); `slices_summed` (the localiser's yardstick): each
    slice's passes scaled as the rank that takes it scales them (1 / the feature's own micro-batches), so the
    slices' gradients add up to `micro` times the mean, each computed as that rank computes it.

    An implementation that drives its own step (the adapter's engine hooks, harness.adapters.base): `backward(loss)`
    runs each micro-batch's backward on its mean loss divided as the step divides it, less the part the engine
    divides by itself (its accumulation, the step's reductions), and `micro_step()` follows every backward but the
    last where the engine accumulates them, as it counts its micro-steps (the last one's is the optimizer step,
    which the caller makes); with the reduction switched off between them (no_sync) it steps once."""
    check_feature(feature)  # ValueError for an unknown one
    k = passes_per_step(feature)  # clipping and checkpointing act outside this: one pass, as plain
    switched = reductions_per_step(feature) < k  # the reduction runs on the last pass only
    if switched and set_sync is None:
        raise ValueError(f"feature {feature!r} needs set_sync (the adapter's set_gradient_sync)")
    slices = rank_slices(x, y, micro) if micro > 1 else [(x, y)]
    slices = slices[::-1] if reverse else slices
    batches = [mb for xs, ys in slices for mb in micro_batches(xs, ys, k)]
    scale = k if slices_summed else len(batches)
    total = None
    for i, (xm, ym) in enumerate(batches):
        if switched:
            set_sync(i == len(batches) - 1)
        mark("forward")
        out = mark("after_forward", model(xm))
        loss = spec.loss(out.float() if has(feature, "bf16") else out, ym)  # the loss in fp32, as plain
        mark("backward")
        if backward is not None:
            backward(loss / (scale // reductions_per_step(feature)) if scale > 1 else loss)
            if micro_step is not None and not switched and i < len(batches) - 1:
                micro_step()
        if scale > 1:
            loss = loss / scale
        if backward is None:
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def evaluate(
    feature: str,
    spec,
    model,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    mark: Callable = lambda phase, value=None: value,
) -> list[float]:
    """The evaluation pass (feature eval): a forward of `model` under torch.no_grad() on each held-out
    (inputs, targets) in `batches` (the rank's slice; a reference's micro-batches: the slices its ranks
    take), each loss taken as the training step takes it (in fp32 under bf16). `mark` hears "eval"
    before each forward and "after_eval" once the last and its loss are done: no backward follows a
    no_grad forward, so whatever the implementation gathered for it must be resharded by then
    (harness.measure.timeline). Returns each batch's mean loss."""
    losses = []
    with torch.no_grad():
        for x, y in batches:
            mark("eval")
            out = model(x)
            losses.append(float(spec.loss(out.float() if has(feature, "bf16") else out, y)))
    mark("after_eval")
    return losses
