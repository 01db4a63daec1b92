"""The per-sample gradient norm mutant: a faulty copy of fsdp_impl's ``per_sample_grad_norms``,
run with the product's own by the world task ``per_sample_task`` (a per-sample mutant is a task,
not an adapter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from harness.adapters.fsdp_impl import FsdpImplAdapter
from suites.mutants.injection import with_globals


def per_sample_norms_allreduced():
    """fsdp_impl.per_sample.per_sample_grad_norms whose data layout, before placing the norms at
    their global indices, all-reduces the squared norms position by position over the ranks (as if
    each rank held a partial norm over its parameter shard): with split data it adds different
    samples' norms, with replicated data W copies of the same."""
    from fsdp_impl import per_sample

    class AllReducedLayout(per_sample._Layout):
        def place(self, local_values: Tensor) -> Tensor:
            sq = local_values.double().pow(2).to(self.device)
            dist.all_reduce(sq, group=self.group)
            return super().place(sq.sqrt())

    return with_globals(per_sample.per_sample_grad_norms, _Layout=AllReducedLayout)


PER_SAMPLE_VARIANTS = {"control": None, "mutant": per_sample_norms_allreduced}


def per_sample_task(ctx, p: dict) -> dict:
    """World task: the seeded model sharded by fsdp_impl, this rank's slice of batch `step`, the
    per-sample norms of the global batch by the product ("control") and by the mutant."""
    from fsdp_impl.per_sample import per_sample_grad_norms
    from harness.train.data import global_batch, local_slice
    from harness.train.models import get_model_spec

    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    model = spec.build().to(ctx.device)
    model = FsdpImplAdapter().wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    x, y = global_batch(spec, p["batch"], p["step"], p["seed"])
    x, y, idx = local_slice(x, y, ctx.rank, ctx.world_size, p["mode"])
    out = {}
    for variant, make in PER_SAMPLE_VARIANTS.items():
        if variant not in p.get("variants", PER_SAMPLE_VARIANTS):
            continue
        fn = per_sample_grad_norms if make is None else make()
        out[variant] = fn(model, spec.loss, x.to(ctx.device), y.to(ctx.device), idx, group=ctx.group).tolist()
    return {"rank": ctx.rank, "norms": out}
