"""fsdp_impl against PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): step time and peak memory.

    python -m harness.bench.fsdp_vs_fsdp2 --world-sizes 1,2,4,8 --model tinylm --steps 20

For each world size ONE world runs every implementation on the same seeded model, the same
optimizer and the same data (each rank its split of the same global batch):

  memory  each implementation alone (built, warmed up, one step under ``PeakMemory``, freed), so
          no other model's tensors share the window; the figure is the max over ranks of the peak
  time    all implementations built side by side and stepped in turn, step by step (interleaved,
          so a change of load on a shared machine hits all of them alike); a barrier starts every
          timed step on all ranks together; a step's time is the slowest rank's; the figure is the
          median over the measured steps; warm-up steps are not measured

Rows: ``fsdp_impl`` (its default policy: gradient shards summed in float64) and
``fsdp_impl[reduce fp32]`` (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``), each against the
same FSDP2 figures (FSDP2's default: reduce in the gradient dtype, float32). Ratio = fsdp_impl / FSDP2
(> 1: fsdp_impl is slower / uses more memory).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

from harness.adapters import load_adapter
from harness.adapters.fsdp_impl import FsdpImplAdapter
from harness.execute.world import World
from harness.measure import PeakMemory, state_bytes
from harness.train.data import global_batch, local_slice
from harness.train.models import get_model_spec

TASK = "harness.bench.fsdp_vs_fsdp2:bench_rank"
FSDP2 = "torch_fsdp2"
IMPLS = ("fsdp_impl", "fsdp_impl[reduce fp32]", FSDP2)


class FsdpImplFp32Reduce(FsdpImplAdapter):
    """fsdp_impl with its gradient reduction summed in float32 instead of the default float64."""

    name = "fsdp_impl[reduce fp32]"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        model.to(device)
        for unit in units:
            fully_shard(unit, process_group=group, mp_policy=policy)
        return fully_shard(model, process_group=group, mp_policy=policy)


def _adapter(label: str):
    return FsdpImplFp32Reduce() if label == "fsdp_impl[reduce fp32]" else load_adapter(label)


def _build(label: str, p: dict, ctx):
    spec = get_model_spec(p["model"])
    adapter = _adapter(label)
    torch.manual_seed(p["seed"])
    model = spec.build().to(ctx.device)
    wrapped = adapter.wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    optimizer = adapter.make_optimizer(wrapped, name=p["optimizer"], lr=p["lr"])
    return spec, adapter, wrapped, optimizer


def _batch(spec, p: dict, step: int, ctx):
    inputs, targets = global_batch(spec, p["global_batch"], step, p["seed"])
    x, y, _ = local_slice(inputs, targets, ctx.rank, ctx.world_size, p["data_mode"])
    return x.to(ctx.device), y.to(ctx.device)


def _step(spec, adapter, wrapped, optimizer, x, y) -> float:
    loss = spec.loss(wrapped(x), y)
    loss.backward()
    adapter.after_backward(wrapped, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _sync(ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def bench_rank(ctx, p: dict) -> dict:
    """Runs on every rank: {label: {"peak", "state", "times_s", "losses"}}."""
    out: dict[str, dict] = {label: {} for label in p["impls"]}
    # memory: one implementation alive at a time
    for label in p["impls"]:
        spec, adapter, wrapped, optimizer = _build(label, p, ctx)
        for step in range(1, p["warmup"] + 1):  # optimizer state exists after the first step
            _step(spec, adapter, wrapped, optimizer, *_batch(spec, p, step, ctx))
        x, y = _batch(spec, p, p["warmup"] + 1, ctx)
        mem = PeakMemory(wrapped, optimizer, ctx.device, extra=(x, y))
        with mem:
            _step(spec, adapter, wrapped, optimizer, x, y)
        out[label]["peak"] = mem.result()["peak"]
        out[label]["state"] = sum(state_bytes(wrapped, optimizer).values())
        del spec, adapter, wrapped, optimizer, mem
        gc.collect()
    # time: all alive, stepped in turn
    runs = {label: _build(label, p, ctx) for label in p["impls"]}
    for label in p["impls"]:
        out[label]["times_s"], out[label]["losses"] = [], []
    for step in range(1, p["warmup"] + p["steps"] + 1):
        for label, (spec, adapter, wrapped, optimizer) in runs.items():
            x, y = _batch(spec, p, step, ctx)
            dist.barrier(group=ctx.group)
            _sync(ctx)
            t0 = time.perf_counter()
            loss = _step(spec, adapter, wrapped, optimizer, x, y)
            _sync(ctx)
            if step > p["warmup"]:
                out[label]["times_s"].append(time.perf_counter() - t0)
                out[label]["losses"].append(loss)
    return out


def summarize(per_rank: list[dict]) -> dict[str, dict]:
    """Per implementation: median over steps of the slowest rank's time (ms), max peak bytes."""
    out = {}
    for label in per_rank[0]:
        times = [max(r[label]["times_s"][i] for r in per_rank) for i in range(len(per_rank[0][label]["times_s"]))]
        out[label] = {"ms": 1e3 * statistics.median(times),
                      "peak": max(r[label]["peak"] for r in per_rank),
                      "state": max(r[label]["state"] for r in per_rank),
                      "final_loss": per_rank[0][label]["losses"][-1]}
    return out


def table(results: dict[int, dict[str, dict]]) -> str:
    head = ["world size", "variant", "fsdp_impl step ms", "fsdp2 step ms", "ratio",
            "fsdp_impl peak bytes", "fsdp2 peak bytes", "ratio"]
    rows = []
    for w, res in results.items():
        ref = res[FSDP2]
        for label in (lab for lab in res if lab != FSDP2):
            mine = res[label]
            rows.append([str(w), label, f"{mine['ms']:.2f}", f"{ref['ms']:.2f}", f"{mine['ms'] / ref['ms']:.2f}",
                         f"{mine['peak']:,}", f"{ref['peak']:,}", f"{mine['peak'] / ref['peak']:.2f}"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.rjust(n) for c, n in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (n + 2) for n in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def _world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"world sizes must be integers like 1,2,4,8, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m harness.bench.fsdp_vs_fsdp2", description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 4, 8])
    ap.add_argument("--model", default="tinylm")
    ap.add_argument("--steps", type=int, default=20, help="measured steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="steps run before measuring (not timed)")
    ap.add_argument("--global-batch", type=int, default=16, help="split over the ranks; divisible by each W")
    ap.add_argument("--data-mode", choices=["split", "replicated"], default="split")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    get_model_spec(args.model)  # unknown names fail here, in one line
    payload = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
               "global_batch": args.global_batch, "data_mode": args.data_mode,
               "optimizer": args.optimizer, "lr": args.lr, "impls": list(IMPLS)}
    print(f"# fsdp_impl vs FSDP2: model={args.model} optimizer={args.optimizer} "
          f"global_batch={args.global_batch} ({args.data_mode}) steps={args.steps} (+{args.warmup} warm-up) "
          f"backend={args.backend}")
    print(f"# torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"load average at start {os.getloadavg()[0]:.1f}")
    results: dict[int, dict[str, dict]] = {}
    for w in args.world_sizes:
        t0 = time.perf_counter()
        with World(w, args.backend, timeout_s=args.timeout) as world:
            results[w] = summarize(world.call(TASK, payload))
        losses = ", ".join(f"{k} {v['final_loss']:.4f}" for k, v in results[w].items())
        print(f"# W={w}: {time.perf_counter() - t0:.1f} s; final loss {losses}", flush=True)
    print()
    print(table(results))
    print()
    print("ratio = fsdp_impl / fsdp2. Step time: median over measured steps of the slowest rank. Peak: "
          "max over ranks of the peak bytes tracked over one step (PeakMemory; CPU: tensors seen by the "
          "tracker, CUDA: max_memory_allocated).")
    print(f"# load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
