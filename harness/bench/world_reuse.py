"""World reuse vs a fresh spawned world per scenario, same matrix, same invocation.

    python -m harness.bench.world_reuse --world-sizes 1,2,4 --steps 3

Prints the wall time of the matrix run the harness's way (one forkserver world per world size,
reused for every scenario of that size) and of the same matrix with a `spawn` world started and
torn down for each scenario, and their ratio. Both runs must produce the same losses; the script
says so (a reuse bug that leaked state between scenarios would show here).
"""

from __future__ import annotations

import argparse
import time

from harness import options as opt
from harness.execute.world import WorldPool
from harness.phases import run_matrix
from harness.preflight import checked_matrix


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=opt.world_sizes, default=(1, 2, 4))
    p.add_argument("--impl", dest="impls", type=opt.impls, default=("fsdp_impl",))
    p.add_argument("--models", type=opt.models, default=("mlp",))
    p.add_argument("--optimizers", type=opt.optimizers, default=("adamw",))
    p.add_argument("--steps", type=opt.positive_int, default=3)
    ns = p.parse_args(argv)
    scenarios = checked_matrix(ns).scenarios()
    print(f"matrix: {len(scenarios)} scenarios, world sizes {ns.world_sizes}")

    t0 = time.perf_counter()
    reused = run_matrix(scenarios)
    t_reuse = time.perf_counter() - t0
    pool = WorldPool(start_method="spawn", reuse=False, timeout_s=600.0)
    t0 = time.perf_counter()
    try:
        fresh = run_matrix(scenarios, pool=pool)
    finally:
        pool.close()
    t_fresh = time.perf_counter() - t0

    same = reused.tables["steps"]["loss"].tolist() == fresh.tables["steps"]["loss"].tolist()
    print(f"{'mode':<34} {'worlds':>7} {'wall s':>8}")
    print(f"{'reuse (forkserver, one per size)':<34} {reused.worlds_started:>7} {t_reuse:>8.1f}")
    print(f"{'fresh spawn world per scenario':<34} {pool.worlds_started:>7} {t_fresh:>8.1f}")
    print(f"speed-up: {t_fresh / t_reuse:.1f}x; identical losses in both runs: {same}")


if __name__ == "__main__":
    main()
