"""What the harness adds to training: each cell trained bare, then the harness's way, in the same worlds.

    python -m harness.bench.harness_cost --world-sizes 1,2,4,8 --impl fsdp_impl,torch_fsdp2

Bare: the adapter's wrap and optimizer, then per step the plain feature's forward and backward
(harness.train.features.forward_backward, the step code the harness runs), the adapter's after_backward and
the optimizer step, timed on every rank between two barriers; nothing measured, nothing written. The
harness's way: the same cells as scenarios of a matrix (every measurement, snapshot and record of a
rank, and the parent's tables and checks), timed per scenario as the main job's progress lines show it.
The worlds are started before either pass, so neither pays a world's start. Prints per world size the
two totals and their ratio, then the sums: the bare sum is a floor for these cells on this machine,
the time training them takes with nothing verified.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

from harness import options as opt
from harness.core.scenario import REFERENCE_IMPL, Scenario
from harness.execute.world import WorldPool
from harness.phases import run_matrix
from harness.preflight import checked_matrix

BARE_TASK = "harness.bench.harness_cost:train_bare"


def train_bare(ctx, payload: dict) -> float:
    """One cell's training on this rank with nothing of the harness around it; its seconds (the slowest
    rank's is the cell's)."""
    import torch
    import torch.distributed as dist

    from harness.adapters import load_adapter
    from harness.train.data import global_batch, local_slice
    from harness.train.features import forward_backward
    from harness.train.models import get_model_spec

    sc = Scenario(**payload)
    spec, adapter = get_model_spec(sc.model), load_adapter(sc.impl)
    torch.manual_seed(sc.seed)
    model = spec.build()
    wrapped = adapter.wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    optimizer = adapter.make_optimizer(wrapped, name=sc.optimizer, lr=sc.lr)
    batches = [
        local_slice(*global_batch(spec, sc.global_batch, step, sc.seed), ctx.rank, ctx.world_size, sc.data_mode)[:2]
        for step in range(1, sc.steps + 1)
    ]
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    for x, y in batches:
        forward_backward("plain", spec, wrapped, x.to(ctx.device), y.to(ctx.device))
        adapter.after_backward(wrapped, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=opt.world_sizes, default=(1, 2, 4, 8))
    p.add_argument("--impl", dest="impls", type=opt.impls, default=("fsdp_impl", "torch_fsdp2"))
    p.add_argument("--models", type=opt.models, default=opt.DEFAULT_MODELS)
    p.add_argument("--optimizers", type=opt.optimizers, default=("adamw", "sgd"))
    p.add_argument("--steps", type=opt.steps, default=10)
    ns = p.parse_args(argv)
    scenarios = checked_matrix(ns).scenarios()
    cells = [s for s in scenarios if s.impl != REFERENCE_IMPL and s.world_size in ns.world_sizes]
    print(
        f"{len(cells)} cells (and the {len(scenarios) - len(cells)} runs they are compared with), "
        f"world sizes {','.join(map(str, ns.world_sizes))}, {ns.steps} steps"
    )
    bare, harnessed = defaultdict(float), defaultdict(float)
    with WorldPool(keep=True) as pool:
        for w in sorted({s.world_size for s in scenarios}):
            pool.get(w)
        for sc in cells:
            payload = dataclasses.asdict(sc)
            bare[sc.world_size] += max(pool.get(sc.world_size, sc.backend).call(BARE_TASK, payload))
        ids = {s.id for s in cells}

        def progress(_i, _n, sc, seconds):
            if sc.id in ids:
                harnessed[sc.world_size] += seconds

        res = run_matrix(scenarios, pool=pool, progress=progress)
    if res.failed:
        print(f"note: {len(res.failed)} verdicts failed (the timing stands; the run is not a verification)")
    print(f"{'W':>3} {'bare s':>8} {'harness s':>10} {'ratio':>6}")
    for w in sorted(bare):
        print(f"{w:>3} {bare[w]:>8.3f} {harnessed[w]:>10.3f} {harnessed[w] / bare[w]:>5.2f}x")
    b, h = sum(bare.values()), sum(harnessed.values())
    print(f"all {b:>8.3f} {h:>10.3f} {h / b:>5.2f}x   (bare: a floor for these cells on this machine)")


if __name__ == "__main__":
    main()
