"""fsdp_impl against PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): step time and peak memory.

    python -m harness.bench.fsdp_vs_fsdp2 --world-sizes 1,2,4,8 --model tinylm --steps 20
    python -m harness.bench.fsdp_vs_fsdp2 --world-sizes 1,2,4 --model tinylm,lm_50m --steps 5 --warmup 2 \
        --global-batch 4

``--model`` takes a comma-separated list of zoo models (``lm_50m``: ~55M parameters, the size at
which sharding costs show; ``tinylm``: ~30K, where per-call overheads dominate); one table per model,
with its parameter count. For each world size ONE world (started once, reused for every model) runs
every implementation on the same seeded model, the same optimizer and the same data (each rank its
split of the same global batch):

  memory  each implementation alone (built, warmed up, one step under ``PeakMemory``, freed), so
          no other model's tensors share the window; the figure is the max over ranks of the peak
  time    all implementations built side by side and stepped in turn, step by step (interleaved,
          so a change of load on a shared machine hits all of them alike); a barrier starts every
          timed step on all ranks together; a step's time is the slowest rank's; the figure is the
          median over the measured steps; warm-up steps are not measured. Beside the ratio of the
          medians: the range (min-max) of the per-step ratios (step i of fsdp_impl over step i of
          FSDP2, run back to back), which shows how much the machine's load moved the figure, and
          the ratio of CPU time (the process's CPU seconds in a step, the most over ranks, median
          over steps), which load inflates less than wall time but which misses time spent waiting
          on a collective

Rows: ``fsdp_impl`` (its default policy: gradient shards summed in float64),
``fsdp_impl[reduce fp32]`` (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``) and
``fsdp_impl[invariant]`` (its batch-invariant step, fsdp_impl.invariant: the global batch as L micro-batches, 8 or
the largest power of two below that the batch and the world sizes allow, summed in one fixed tree, so L / W
forward and backward passes a step), with ``--deepspeed`` ``deepspeed_zero3`` (DeepSpeed's ZeRO-3 through its own
engine, harness/adapters/deepspeed.py), each against the
same FSDP2 figures (FSDP2's default: reduce in the gradient dtype, float32). Ratio = the row's / FSDP2
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

from harness import options as opt
from harness.adapters import load_adapter
from harness.adapters.fsdp_impl import FsdpImplAdapter
from harness.core.policy import INVARIANT_MICRO_BATCHES
from harness.execute.world import World
from harness.measure import PeakMemory, state_bytes
from harness.train.data import global_batch, local_slice
from harness.train.models import get_model_spec

TASK = "harness.bench.fsdp_vs_fsdp2:bench_rank"
FSDP2 = "torch_fsdp2"
INVARIANT = "fsdp_impl[invariant]"
DEEPSPEED = "deepspeed_zero3"
IMPLS = ("fsdp_impl", "fsdp_impl[reduce fp32]", INVARIANT, FSDP2)


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
    return {"fsdp_impl[reduce fp32]": FsdpImplFp32Reduce, INVARIANT: FsdpImplAdapter}.get(label, load_adapter)(
        *(() if label in ("fsdp_impl[reduce fp32]", INVARIANT) else (label,))
    )


def _build(label: str, p: dict, ctx):
    spec = get_model_spec(p["model"])
    adapter = _adapter(label)
    torch.manual_seed(p["seed"])
    model = spec.build().to(ctx.device)
    wrapped = adapter.wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    optimizer = adapter.make_optimizer(wrapped, name=p["optimizer"], lr=p["lr"])
    return spec, adapter, wrapped, optimizer


def _batch(spec, p: dict, step: int, ctx, contiguous: bool = False):
    """This rank's batch: local_slice's (strided with split data), or its contiguous 1 / W (`contiguous`: the
    invariant step's micro-batch index runs over contiguous slices, so its losses are the same at every W)."""
    inputs, targets = global_batch(spec, p["global_batch"], step, p["seed"])
    if contiguous and p["data_mode"] == "split":
        n = inputs.shape[0] // ctx.world_size
        x, y = inputs[ctx.rank * n : (ctx.rank + 1) * n], targets[ctx.rank * n : (ctx.rank + 1) * n]
    else:
        x, y, _ = local_slice(inputs, targets, ctx.rank, ctx.world_size, p["data_mode"])
    return x.to(ctx.device), y.to(ctx.device)


def _step(spec, adapter, wrapped, optimizer, x, y, invariant: str = "", micro: int = 0) -> float:
    """One training step; `invariant` ("split" / "replicated"): through fsdp_impl's batch-invariant step, as `micro`
    micro-batches."""
    if invariant:
        loss = adapter.invariant_forward_backward(
            wrapped, spec.loss, x, y, micro_batches=micro, replicated=invariant == "replicated"
        )
    elif callable(getattr(adapter, "step", None)):  # an engine drives its own step (DeepSpeed's)
        loss = spec.loss(wrapped(x), y)
        adapter.backward(wrapped, loss)
        adapter.step(wrapped, optimizer)
        return float(loss.detach())
    else:
        loss = spec.loss(wrapped(x), y)
        loss.backward()
    adapter.after_backward(wrapped, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _sync(ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def _next_forward_hook(mem, root):
    """A global pre-forward hook that clears `mem`'s per-module statistics before each forward of `root`."""
    return torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, a: mem.next_forward() if m is root and mem.tracker is not None else None
    )


def bench_rank(ctx, p: dict) -> dict:
    """Runs on every rank: {label: {"peak", "state", "times_s", "cpu_s", "losses"}}."""
    out: dict[str, dict] = {label: {} for label in p["impls"]}
    # memory: one implementation alive at a time
    for label in p["impls"]:
        spec, adapter, wrapped, optimizer = _build(label, p, ctx)
        mode = p["data_mode"] if label == INVARIANT else ""
        for step in range(1, p["warmup"] + 1):  # optimizer state exists after the first step
            _step(spec, adapter, wrapped, optimizer, *_batch(spec, p, step, ctx, bool(mode)), mode, p.get("micro", 0))
        x, y = _batch(spec, p, p["warmup"] + 1, ctx, bool(mode))
        mem = PeakMemory(wrapped, optimizer, ctx.device, extra=(x, y))
        # the invariant step runs several forwards of the root in the window: the tracker's per-module statistics
        # are cleared before each (a global hook made before the tracker's own runs before it)
        hook = _next_forward_hook(mem, wrapped) if mode else None
        try:
            with mem:
                _step(spec, adapter, wrapped, optimizer, x, y, mode, p.get("micro", 0))
        finally:
            if hook is not None:
                hook.remove()
        out[label]["peak"] = mem.result()["peak"]
        out[label]["state"] = sum(state_bytes(wrapped, optimizer).values())
        del spec, adapter, wrapped, optimizer, mem
        gc.collect()
    # time: all alive, stepped in turn
    runs = {label: _build(label, p, ctx) for label in p["impls"]}
    for label in p["impls"]:
        out[label]["times_s"], out[label]["cpu_s"], out[label]["losses"] = [], [], []
    for step in range(1, p["warmup"] + p["steps"] + 1):
        for label, (spec, adapter, wrapped, optimizer) in runs.items():
            x, y = _batch(spec, p, step, ctx, label == INVARIANT)
            dist.barrier(group=ctx.group)
            _sync(ctx)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = _step(
                spec, adapter, wrapped, optimizer, x, y, p["data_mode"] if label == INVARIANT else "", p.get("micro", 0)
            )
            _sync(ctx)
            if step > p["warmup"]:
                out[label]["times_s"].append(time.perf_counter() - t0)
                out[label]["cpu_s"].append(time.process_time() - c0)
                out[label]["losses"].append(loss)
    return out


def summarize(per_rank: list[dict]) -> dict[str, dict]:
    """Per implementation: median over steps of the slowest rank's time (ms) and the steps' times
    ("step_ms"), the same of CPU time ("cpu_ms"), max peak bytes."""
    out = {}
    for label in per_rank[0]:
        steps = range(len(per_rank[0][label]["times_s"]))
        times = [max(r[label]["times_s"][i] for r in per_rank) for i in steps]
        cpu = [max(r[label]["cpu_s"][i] for r in per_rank) for i in steps]
        out[label] = {
            "ms": 1e3 * statistics.median(times),
            "step_ms": [1e3 * t for t in times],
            "cpu_ms": 1e3 * statistics.median(cpu),
            "peak": max(r[label]["peak"] for r in per_rank),
            "state": max(r[label]["state"] for r in per_rank),
            "final_loss": per_rank[0][label]["losses"][-1],
        }
    return out


COLUMNS = (
    "world size",
    "variant",
    "variant step ms",
    "fsdp2 step ms",
    "ratio",
    "per-step ratios",
    "cpu ratio",
    "variant peak bytes",
    "fsdp2 peak bytes",
    "ratio",
)


def table(results: dict[int, dict[str, dict]]) -> str:
    """One markdown table: a row per (world size, fsdp_impl variant), each against FSDP2's figures."""
    head = list(COLUMNS)
    rows = []
    for w, res in results.items():
        ref = res[FSDP2]
        for label in (lab for lab in res if lab != FSDP2):
            mine = res[label]
            paired = [a / b for a, b in zip(mine["step_ms"], ref["step_ms"])]
            rows.append(
                [
                    str(w),
                    label,
                    f"{mine['ms']:.2f}",
                    f"{ref['ms']:.2f}",
                    f"{mine['ms'] / ref['ms']:.2f}",
                    f"{min(paired):.2f}-{max(paired):.2f}",
                    f"{mine['cpu_ms'] / ref['cpu_ms']:.2f}",
                    f"{mine['peak']:,}",
                    f"{ref['peak']:,}",
                    f"{mine['peak'] / ref['peak']:.2f}",
                ]
            )
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


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for row in f:
                if row.startswith("model name"):
                    return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(backend: str) -> str:
    """The machine the figures come from: CPU (and its kernels' capability), torch, GPU if used."""
    cap = torch.backends.cpu.get_cpu_capability()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = (
        f"# machine: {_cpu_name()} ({cap}), {cpus} CPUs usable, torch {torch.__version__}, "
        f"python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"intra-op threads {torch.get_num_threads()}"
    )
    if backend == "nccl" and torch.cuda.is_available():
        text += f", GPU {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return text


def _n_params(name: str) -> int:
    with torch.device("meta"):
        model = get_model_spec(name).build()
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def invariant_micro_batches(batch: int, world_sizes) -> int:
    """L for the invariant row: the largest power of two up to INVARIANT_MICRO_BATCHES that divides the global
    batch and that every world size divides; 0 where none does."""
    micro = INVARIANT_MICRO_BATCHES
    while micro and (batch % micro or any(micro % w for w in world_sizes)):
        micro //= 2
    return micro


def main(argv: list[str] | None = None) -> dict[str, dict[int, dict[str, dict]]]:
    """Runs the benchmark, prints its tables; returns {model: {world size: summarize(...)}}."""
    ap = argparse.ArgumentParser(prog="python -m harness.bench.fsdp_vs_fsdp2", description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=_world_sizes, default=[1, 2, 4, 8])
    ap.add_argument(
        "--model",
        type=opt.models,
        default=("tinylm",),
        help="comma-separated zoo models, e.g. tinylm,lm_50m; one table each",
    )
    ap.add_argument("--steps", type=int, default=20, help="measured steps (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="steps run before measuring (not timed)")
    ap.add_argument("--global-batch", type=int, default=16, help="split over the ranks; divisible by each W")
    ap.add_argument("--data-mode", choices=["split", "replicated"], default="split")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world and model")
    ap.add_argument(
        "--deepspeed",
        action="store_true",
        help="add a row for DeepSpeed's ZeRO-3 through its own engine (the deepspeed extra), against FSDP2 too",
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be >= 1")
    if args.data_mode == "split" and any(args.global_batch % w for w in args.world_sizes):
        ap.error(f"--global-batch {args.global_batch} must be divisible by every world size {args.world_sizes}")
    models = list(dict.fromkeys(args.model))
    n_params = {m: _n_params(m) for m in models}  # unknown names fail here, before any world starts
    micro = invariant_micro_batches(args.global_batch, args.world_sizes)
    impls = [label for label in IMPLS if label != INVARIANT or micro]
    if args.deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError as exc:
            ap.error(f"--deepspeed needs DeepSpeed (pip install -e '.[deepspeed]'): {exc}")
        impls.insert(impls.index(FSDP2), DEEPSPEED)
    payload = {
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "global_batch": args.global_batch,
        "data_mode": args.data_mode,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "impls": impls,
        "micro": micro,
    }
    print(
        f"# fsdp_impl vs FSDP2: models {', '.join(f'{m} ({n_params[m]:,} parameters)' for m in models)}; "
        f"optimizer={args.optimizer} global_batch={args.global_batch} ({args.data_mode}) "
        f"steps={args.steps} (+{args.warmup} warm-up) backend={args.backend}"
    )
    print(machine_line(args.backend))
    print(
        f"# {INVARIANT}: L = {micro} micro-batches a step"
        if micro
        else f"# {INVARIANT} left out: no power of two up to {INVARIANT_MICRO_BATCHES} divides the global batch "
        f"({args.global_batch}) and is divided by every world size"
    )
    print(f"# load average at start {os.getloadavg()[0]:.1f}", flush=True)
    t_all = time.perf_counter()
    results: dict[str, dict[int, dict[str, dict]]] = {m: {} for m in models}
    for w in args.world_sizes:
        with World(w, args.backend, timeout_s=args.timeout) as world:
            for m in models:
                t0 = time.perf_counter()
                res = results[m][w] = summarize(world.call(TASK, {**payload, "model": m}))
                losses = ", ".join(f"{k} {v['final_loss']:.4f}" for k, v in res.items())
                print(f"# W={w} {m}: {time.perf_counter() - t0:.1f} s; final loss {losses}", flush=True)
    for m in models:
        print()
        print(f"## {m}: {n_params[m]:,} parameters")
        print()
        print(table(results[m]))
    print()
    print(
        "ratio = variant / fsdp2 (<= 1: the variant as fast / as light). Step time: median over measured steps "
        "of the slowest rank; per-step ratios: min-max over the measured steps of step i / step i (the spread "
        "shows the machine's load); cpu ratio: of the median CPU time of a step (process CPU seconds, the most "
        "over ranks). Peak: max over ranks of the peak bytes tracked over one step (PeakMemory; CPU: tensors "
        "seen by the tracker, CUDA: max_memory_allocated)."
    )
    print(f"# wall {time.perf_counter() - t_all:.1f} s; load average at end {os.getloadavg()[0]:.1f}")
    return results


if __name__ == "__main__":
    main()
