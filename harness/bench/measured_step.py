"""The measured step's peak tracker against the step it measures, in one process, one thread.

    python -m harness.bench.measured_step --models mlp,tinylm --repeats 30

Per model (the zoo's, AdamW, a batch of 8): one training step plain, under an empty Python dispatch mode (what
any tracker that sees every operation from Python costs before it does anything) and under the harness's
`PeakMemory` (harness.measure.memory, the tracker of every scenario's measured step), the three in turn
`--repeats` times after warm-up steps. Prints the operations a step dispatches, the fastest and the median
milliseconds of each way, and each against the plain step: the floor a Python tracker cannot go below, and what
the harness's adds to it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

from harness import options as opt

WAYS = ("plain", "empty mode", "peak tracker")


def measure(model_name: str, repeats: int, warmup: int = 3) -> dict:
    """{"ops": operations a step dispatches, way: [seconds of each repeat]} for one model."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.measure.memory import PeakMemory
    from harness.train.models import get_model_spec

    class Empty(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Empty.ops += 1
            return func(*args, **(kwargs or {}))

    spec = get_model_spec(model_name)
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = spec.make_batch(8, 1, 0)

    def step() -> None:
        spec.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    with Empty():
        step()
    out: dict = {"ops": Empty.ops, **{way: [] for way in WAYS}}
    contexts = {
        "plain": contextlib.nullcontext,
        "empty mode": Empty,
        "peak tracker": lambda: PeakMemory(model, optimizer, "cpu"),
    }
    gc.collect()
    gc.freeze()  # as a rank does (harness.execute.preloaded): the tracker's entry collects only what is new
    try:
        for _ in range(repeats):
            for way in WAYS:
                ctx = contexts[way]()
                ctx.__enter__()
                t0 = time.perf_counter()
                step()
                out[way].append(time.perf_counter() - t0)
                ctx.__exit__(None, None, None)
    finally:
        gc.unfreeze()
    return out


def table(results: dict[str, dict]) -> str:
    head = f"{'model':<12} {'ops':>5}  " + "  ".join(f"{w + ' ms (min/median)':>30}" for w in WAYS)
    lines = [head]
    for model, r in results.items():
        plain = min(r["plain"])
        cells = []
        for way in WAYS:
            fastest, median = min(r[way]) * 1e3, statistics.median(r[way]) * 1e3
            ratio = "" if way == "plain" else f" {min(r[way]) / plain:5.2f}x"
            cells.append(f"{fastest:9.2f} / {median:9.2f}{ratio:>7}")
        lines.append(f"{model:<12} {r['ops']:>5}  " + "  ".join(f"{c:>30}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=opt.models, default=("mlp", "tinylm"))
    p.add_argument("--repeats", type=opt.positive_int, default=30, help="steps of each way (default 30)")
    ns = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # a rank's one intra-op thread
    results = {}
    for model in ns.models:
        print(f"{model}: {ns.repeats} steps each way ...", flush=True)
        results[model] = measure(model, ns.repeats)
    print(table(results))
    print("ratios: the fastest step of each way against the fastest plain step")


if __name__ == "__main__":
    main()
