"""fsdp_worlds tasks for hybrid sharding (HSDP, R replicas x S shards): training against the plain
model, the reduction itself, accumulation with sync off, clipping, buffers, refused layouts.

The groups come from ``fsdp_impl.hybrid_groups`` and are made once per (world, replicas) and kept
in this worker (creating groups is slow, and every rank makes the same ones in the same order).
With ``wrap`` False a task trains the plain model (the world-size-1 reference).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import fsdp_impl.group as fsdp_group
from fsdp_impl import clip_grad_norm_, fully_shard, hybrid_groups, materialize_meta, set_requires_gradient_sync
from fsdp_impl.collectives import hybrid_reduce_mean
from fsdp_impl.state import units
from harness.optimizers import make_optimizer
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import full_grads, local_batch, named_full, patched, to_numpy
from suites.fsdp_impl.worlds.wrapping import WithBuffer

_GROUPS: dict[tuple, tuple] = {}  # (world size, replicas, group kind) -> this rank's groups


def groups(ctx, replicas: int) -> tuple:
    key = (ctx.world_size, replicas, "hybrid")
    if key not in _GROUPS:
        _GROUPS[key] = hybrid_groups(replicas, ctx.group)
    return _GROUPS[key]


def build(p: dict, ctx) -> tuple[nn.Module, object]:
    """The seeded model; with ``wrap`` (default) every unit, then the root, sharded as R x S."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    if p.get("wrap", True):
        shard_hybrid(model, spec, ctx, p["replicas"])
    return model, spec


def shard_hybrid(model: nn.Module, spec, ctx, replicas: int) -> None:
    shard, rep = groups(ctx, replicas)
    for unit in spec.units(model) + [model]:
        fully_shard(unit, process_group=shard, replicate_group=rep)


@contextlib.contextmanager
def counting_reductions():
    """Count the calls of each gradient reduction the units make (flat and hybrid)."""
    counts = {"flat": 0, "hybrid": 0}
    flat, hybrid = fsdp_group.reduce_scatter_mean, fsdp_group.hybrid_reduce_mean

    def count_flat(*a):
        counts["flat"] += 1
        return flat(*a)

    def count_hybrid(*a):
        counts["hybrid"] += 1
        return hybrid(*a)

    with (
        patched(fsdp_group, "reduce_scatter_mean", count_flat),
        patched(fsdp_group, "hybrid_reduce_mean", count_hybrid),
    ):
        yield counts


def local_shards(model: nn.Module) -> np.ndarray:
    """This rank's rows of every sharded parameter, end to end (float64: exact for fp32 values)."""
    parts = [to_numpy(q.local()).astype(np.float64).ravel() for _, st in units(model) for q in st.params.params]
    return np.concatenate(parts)


# -------------------------------------------------------------------------------------- tasks


def train(ctx, p: dict) -> dict:
    """``steps`` steps of ``optimizer``, each over ``micro`` micro-batches (gradient sync off for all
    but the last, each loss divided by ``micro``). Returns the full parameters after every step, the
    local losses, and (sharded) this rank's rows after every step, the rows each rank holds, and what the
    reductions did: calls per step, and whether any gradient existed before the last micro-batch."""
    model, spec = build(p, ctx)
    wrapped = p.get("wrap", True)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), p.get("lr", 0.01))
    micro = p.get("micro", 1)
    out = {"params": [], "losses": [], "shards": [], "calls": [], "grad_before_last": False}
    with counting_reductions() as counts:
        for step in range(1, p.get("steps", 3) + 1):
            x, y = local_batch(spec, p, step, ctx)
            before = dict(counts)
            for j, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                if wrapped:
                    set_requires_gradient_sync(model, j == micro - 1)
                if j == micro - 1 and any(q.grad is not None for q in model.parameters()):
                    out["grad_before_last"] = True
                loss = spec.loss(model(xm), ym) / micro
                loss.backward()
            out["calls"].append({k: counts[k] - before[k] for k in counts})
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["losses"].append(float(loss.detach()))
            out["params"].append(named_full(model, wrapped))
            if wrapped:
                out["shards"].append(local_shards(model))
    if wrapped:
        qs = [q for _, st in units(model) for q in st.params.params]
        out["layouts"] = [(q.rows, q.row_numel, q.end - q.start) for q in qs]
        out["numel_local"] = sum(q._local_tensor.numel() for q in model.parameters())
        # reductions per step: one per unit with trainable parameters
        out["reducing_units"] = sum(any(q.requires_grad for q in st.params.params) for _, st in units(model))
    return out


def reduction(ctx, p: dict) -> dict:
    """hybrid_reduce_mean on this rank's own random fp32 gradient (seeded by rank) and on one
    gradient every rank shares; returns the inputs and the results (as fp32, as the unit casts)."""
    shard, rep = groups(ctx, p["replicas"])
    n = p["numel"]
    own = torch.randn(n, generator=torch.Generator().manual_seed(100 + ctx.rank)) * p.get("scale", 1.0)
    same = torch.randn(n, generator=torch.Generator().manual_seed(7))
    return {
        "own": to_numpy(own),
        "same": to_numpy(same),
        "mean_own": to_numpy(hybrid_reduce_mean(own, shard, rep, torch.float64).float()),
        "mean_same": to_numpy(hybrid_reduce_mean(same, shard, rep, torch.float64).float()),
        "shard_rank": dist.get_rank(shard),
        "shard_size": dist.get_world_size(shard),
        "shard_ranks": dist.get_process_group_ranks(shard),
        "replicate_ranks": dist.get_process_group_ranks(rep),
    }


def clipped(ctx, p: dict) -> dict:
    """One backward on the same batch everywhere, then clip_grad_norm_ (fsdp_impl's when sharded,
    torch's on the plain model): the norm and the clipped full gradients."""
    model, spec = build(p, ctx)
    x, y = spec.make_batch(p.get("batch", 8), 1, 0)
    spec.loss(model(x), y).backward()
    if p.get("wrap", True):
        norm = clip_grad_norm_(model, p["max_norm"], p["norm_type"])
        return {"norm": float(norm), "grads": full_grads(model)}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p["max_norm"], p["norm_type"])
    return {"norm": float(norm), "grads": {n: to_numpy(q.grad) for n, q in model.named_parameters()}}


def buffers(ctx, p: dict) -> dict:
    """Buffers that differ per rank before sharding (rank-dependent values), after it."""
    shard, rep = groups(ctx, p["replicas"])
    model = WithBuffer(ctx.rank)
    fully_shard(model.lin, process_group=shard, replicate_group=rep)
    fully_shard(model, process_group=shard, replicate_group=rep)
    return {n: to_numpy(b) for n, b in model.named_buffers()}


def bad_replicas(ctx, replicas: int) -> str:
    """The error hybrid_groups gives for a group size that `replicas` does not divide ('' if none)."""
    try:
        hybrid_groups(replicas, ctx.group)
    except ValueError as exc:
        return str(exc)
    return ""


def bad_layout(ctx, case: str) -> str:
    """fully_shard with groups that do not form the hybrid layout (W = 4): the error text."""
    if case == "same_group":  # WORLD as both: every rank shares more than itself with its replicas
        shard = rep = ctx.group
    else:  # shard groups {0,1} {2,3}; "replicas" {0,3} {1,2}: positions 0 and 1 would be averaged
        key = (ctx.world_size, 0, case)
        if key not in _GROUPS:
            made = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 3], [1, 2])]
            _GROUPS[key] = (made[ctx.rank // 2], made[2 + (0 if ctx.rank in (0, 3) else 1)])
        shard, rep = _GROUPS[key]
    try:
        fully_shard(nn.Linear(4, 4), process_group=shard, replicate_group=rep)
    except ValueError as exc:
        return str(exc)
    return ""


def subgroup(ctx, p: dict) -> dict:
    """hybrid_groups over a strict subgroup (evens / odds of W = 4): the groups' global ranks, and one
    hybrid reduction over them."""
    key = (ctx.world_size, p["replicas"], "subgroup")
    if key not in _GROUPS:
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        _GROUPS[key] = hybrid_groups(p["replicas"], evens if ctx.rank % 2 == 0 else odds)
    shard, rep = _GROUPS[key]
    g = torch.full((5,), float(ctx.rank))
    return {
        "shard_ranks": dist.get_process_group_ranks(shard),
        "replicate_ranks": dist.get_process_group_ranks(rep),
        "mean": to_numpy(hybrid_reduce_mean(g, shard, rep, torch.float64).float()),
    }


def meta_init(ctx, p: dict) -> dict:
    """Meta build -> hybrid fully_shard -> seed -> materialize_meta, against the eager build."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    eager = {k: to_numpy(v) for k, v in spec.build().named_parameters()}
    with torch.device("meta"):
        model = spec.build()
    shard_hybrid(model, spec, ctx, p["replicas"])
    torch.manual_seed(p["seed"])
    materialize_meta(model, "cpu")
    return {"eager": eager, "meta": named_full(model, True), "shards": local_shards(model)}
