"""What tracing costs the localiser: a traced step against an untraced one, same scenario, same world.

    python -m harness.bench.localize_overhead --model tinylm --world-size 4 --steps 6

Runs the scenario untraced, then traced (every op seen by the tracer on every rank, the compared ones hashed,
values kept up to 32 MiB per rank, the rank's parameters and gradients copied at each phase boundary;
harness.train.trace), alternating `--repeats` times, and prints the mean step time of each (the steps after
the measured one: the task's own step_time_s, the slowest rank) and their ratio. A run that is not localised
is never traced. The ratios it printed, dated, with the machine and its load: reports/performance.md#the-localiser.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from harness import options as opt
from harness.core.scenario import Scenario
from harness.execute.executor import TASK, payload_of
from harness.execute.world import WorldPool
from harness.localize.replay import KEEP_BYTES


def _step_time(world, sc: Scenario, folder: str, traced: bool, keep_bytes: int = KEEP_BYTES) -> float:
    payload = payload_of(sc, folder, set())
    if traced:
        payload["trace"] = {"steps": sc.steps, "keep_bytes": keep_bytes}
    return max(r["step_time_s"] for r in world.call(TASK, payload))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tinylm")
    p.add_argument("--impl", default="fsdp_impl")
    p.add_argument("--world-size", type=opt.positive_int, default=4)
    p.add_argument("--data-mode", choices=("replicated", "split"), default="replicated")
    p.add_argument("--steps", type=opt.steps, default=6)
    p.add_argument("--repeats", type=opt.positive_int, default=3)
    ns = p.parse_args(argv)
    sc = Scenario(ns.impl, ns.model, ns.world_size, ns.data_mode, "adamw", steps=ns.steps)
    plain, traced = [], []
    with WorldPool() as pool, tempfile.TemporaryDirectory(prefix="fsdp-bench-") as d:
        world = pool.get(sc.world_size, sc.backend)
        _step_time(world, sc, d, False)  # warm-up: imports, first-touch allocations
        for _ in range(ns.repeats):
            plain.append(_step_time(world, sc, d, False))
            traced.append(_step_time(world, sc, d, True))
    a, b = statistics.mean(plain), statistics.mean(traced)
    print(
        f"{sc.id}: untraced step {a * 1e3:.1f} ms, traced step {b * 1e3:.1f} ms, ratio {b / a:.2f}x "
        f"({ns.repeats} runs of {ns.steps} steps each, the slowest rank's mean step)"
    )


if __name__ == "__main__":
    main()
