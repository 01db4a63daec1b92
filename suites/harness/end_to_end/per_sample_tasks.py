"""Rank tasks the per-sample tests run that the product does not: what fsdp_impl's gather by
index refuses, and Opacus' tensor-parallel norms (shown to be the wrong tool for a data-parallel
layout). The product's tasks are in harness/per_sample/tasks.py."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from harness.per_sample.tasks import per_sample_losses
from harness.train.data import global_batch, local_slice
from harness.train.models import get_model_spec


def refused_indices_task(ctx, indices_per_rank: list[list[int]]) -> str:
    """What ``gather_by_index`` raises on this rank for these per-rank indices ('' if nothing)."""
    from fsdp_impl.per_sample import gather_by_index

    idx = torch.tensor(indices_per_rank[ctx.rank])
    try:
        gather_by_index(torch.zeros(len(idx), dtype=torch.float64), idx, group=ctx.group)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return ""


def opacus_tp_task(ctx, p: dict) -> dict:
    """Opacus' ghost_tp norms on a (dp = W) x (tp = 1) mesh: each Linear ColwiseParallel over its
    tensor-parallel group of ONE rank, so the local norms are already complete. Returns the norms
    ``get_norm_sample()`` gives (local positions) and the size of every group it all-reduced over."""
    import warnings

    from opacus.grad_sample import GradSampleModuleFastGradientClippingTP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    spec = get_model_spec("mlp")
    torch.manual_seed(p["seed"])
    model = spec.build()
    mesh = init_device_mesh("cpu", (ctx.world_size, 1), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {f"layers.{i}": ColwiseParallel() for i in range(len(model.layers))})
    x, y = global_batch(spec, p["batch"], p.get("step", 1), p["seed"])
    x, y, idx = local_slice(x, y, ctx.rank, ctx.world_size, p["mode"])
    sizes, original = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        sizes.append(dist.get_world_size(group))
        return original(tensor, *args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModuleFastGradientClippingTP(model, loss_reduction="mean", max_grad_norm=1.0)
        per_sample_losses(spec, gsm(x), y).mean().backward()
        dist.all_reduce = spy  # Opacus calls torch.distributed.all_reduce at call time
        try:
            norms = gsm.get_norm_sample().detach().double().flatten()
        finally:
            dist.all_reduce = original
    every = [None] * ctx.world_size
    dist.all_gather_object(every, idx.tolist(), group=ctx.group)
    out = [math.nan] * p["batch"]  # as Opacus reads them: entry j is this rank's j-th sample
    for indices in every:
        for j, k in enumerate(indices):
            out[k] = float(norms[j])
    return {"rank": ctx.rank, "norms": out, "reduce_group_sizes": sizes, "tp_size": mesh["tp"].size()}
