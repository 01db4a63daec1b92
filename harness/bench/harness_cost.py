"""What the harness adds to training: a run, each of its runs paired with its bare training, in one invocation.

    python -m harness.bench.harness_cost --world-sizes 1,2,4,8 --per-sample     # the main job (docs/running.md)
    python -m harness.bench.harness_cost --world-sizes 1,2 --models mlp         # any `harness run` options

1. The run in this process, as `python -m harness run` makes it with the same options: its worlds' forkserver
   started before the session is made (its preload imported meanwhile), every phase, the report and tables written
   (to a temp folder unless --report says where). Its wall time, and where it went: the world starts, each rank's
   parts of each scenario (harness.core.costs, recorded by harness.train.task), the tables, the checks, each later
   phase and the report.
2. Bare, paired: every run of its matrix that ran (the implementations' cells and the runs they are compared with:
   the plain model's, world size 1's, the probes'), trained again with nothing of the harness around it, in the
   world the run has just used (`PairedPool`): the model built, the adapter's wrap and optimizer, then per step the
   feature's forward and backward (harness.train.features.forward_backward, the step code the harness runs), the
   adapter's after_backward, clipping where the feature clips and the optimizer step (an engine's own where the
   adapter has engine hooks), on every rank between two barriers; nothing measured, written or compared. Its sum
   is the floor: training this matrix with nothing verified. Each run's bare training comes right after the run
   itself, in its world (warm by then: the run paid the world's first use); where the run has scenarios of one size
   side by side, after the last of that size, one at a time in one of its worlds. The seconds of the bare training
   are taken out of every wall time below. Paired within seconds, a ratio measures the harness and not the
   machine: a shared machine's speed moves between minutes, by as much as the margins a ratio is judged by
   (reports/performance.md), which a floor measured before and after the whole run put into every ratio.
3. The first progress line of `python -m harness run` with the same options in a new process (its first scenario
   done): seconds from launch, and to its first line of any kind (the run is then interrupted; --no-first-line
   skips it).

Prints the machine's idle and stolen core-seconds over the run and its bare training (/proc/stat, Linux:
`Machine`), then per world size the runs' seconds both ways and their ratio (the wall time of that size's
scenarios, from the first one's start to the last one's end, less the start of its worlds, against their bare
training, one run at a time; where a world's ranks fit the cores the harness runs scenarios of one size side by
side, harness.execute.executor, and the sum of their own seconds is printed beside it), the run's wall time
against the bare sum (world starts included), and the difference by part, in all and per world size.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import options as opt
from harness.bench.idle_cores import STAT, CpuSeconds, cpu_seconds
from harness.core.scenario import Scenario
from harness.execute.executor import TASK, side_by_side
from harness.execute.world import WorldError, WorldPool, start_forkserver
from harness.session import Session, session_options

BARE_TASK = "harness.bench.harness_cost:train_bare"
# the parts of a rank's scenario outside its training steps, as harness.train.task records them
RANK_PARTS = {
    "census": "memory census and peak tracker set-up (measured step)",
    "snapshots": "full-parameter snapshots (initial and every step)",
    "exchange": "per-step records exchanged (loss, gradient digest, norms)",
    "align": "step barrier",
    "checkpoints": "checkpoints (ckpt)",
    "after": "after the run (plain eval, first non-finite module)",
}


def train_bare(ctx, payload: dict) -> dict:
    """One run's training on this rank with nothing of the harness around it: {"setup": s, "steps": s} (the build,
    wrap and optimizer; the steps), the slowest rank's being the run's."""
    import torch
    import torch.distributed as dist

    from harness.adapters import load_adapter
    from harness.core.features import has
    from harness.train.data import global_batch, local_slice
    from harness.train.features import checkpoint_units, forward_backward, wrap_for
    from harness.train.models import get_model_spec
    from harness.train.task import Engine, clip_for

    sc = Scenario(**payload)
    spec, adapter = get_model_spec(sc.model), load_adapter(sc.impl)
    batches = [
        local_slice(*global_batch(spec, sc.global_batch, step, sc.seed), ctx.rank, ctx.world_size, sc.data_mode)[:2]
        for step in range(1, sc.steps + 1)
    ]
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    torch.manual_seed(sc.seed)
    model = spec.build().to(ctx.device)
    units = spec.units(model)
    if has(sc.feature, "ac"):
        checkpoint_units(units)
    wrapped = wrap_for(sc.feature, adapter, model, units, ctx=ctx)
    optimizer = adapter.make_optimizer(wrapped, name=sc.optimizer, lr=sc.lr)
    engine = Engine(adapter, wrapped, optimizer)
    sync = getattr(adapter, "set_gradient_sync", None)
    set_sync = (lambda enabled: sync(wrapped, enabled)) if callable(sync) else None
    t1 = time.perf_counter()
    for x, y in batches:
        forward_backward(
            sc.feature,
            spec,
            wrapped,
            x.to(ctx.device),
            y.to(ctx.device),
            lambda phase, value=None: value,
            set_sync,
            micro=sc.micro_batches,
            reverse=sc.reverse_micro,
            backward=engine.backward,
            micro_step=engine.micro_step,
        )
        adapter.after_backward(wrapped, optimizer)
        if not engine.clips:
            clip_for(adapter, wrapped, sc.feature, sc.nudge)
        engine.step()
        engine.zero_grad()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)
    t2 = time.perf_counter()
    return {"setup": t1 - t0, "steps": t2 - t1}


def slowest(ranks: list[dict], part: str) -> float:
    """The slowest rank's seconds in `part` of a scenario (0 where no rank recorded it)."""
    return max((r.get("costs", {}).get(part, 0.0) for r in ranks), default=0.0)


def first_progress_line(argv: list[str], report_dir: str) -> tuple[float | None, str, float | None, str]:
    """Seconds from launching `python -m harness run <argv>` to its first progress line ("[  1/N] ...", a scenario
    done), and what it printed before (None: it printed none, then the printed lines say why); then the seconds to
    its first line of any kind, and that line. The run is interrupted at its first progress line."""
    cmd = [sys.executable, "-m", "harness", "run", *argv, "--report", os.path.join(report_dir, "first.md")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    seen, said, any_s = None, [], None
    try:
        for line in proc.stderr:
            if any_s is None:
                any_s = time.perf_counter() - t0
            if line.startswith("["):
                seen = time.perf_counter() - t0
                break
            said.append(line)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return seen, "".join(said[-5:]), any_s, (said[0] if said else "").strip()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the command line `python -m harness run` gets for the first-line measurement (this
    bench's own option and the outputs left out: that run writes to a temp folder)."""
    p = opt.run_options_parser("python -m harness.bench.harness_cost", __doc__.splitlines()[0])
    p.add_argument("--no-first-line", action="store_true", help="skip the first-progress-line measurement")
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = p.parse_args(argv)
    run_argv, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--report", "--save-baseline"):
            skip = True
        elif a not in ("--no-first-line", "--no-report") and not a.startswith(("--report=", "--save-baseline=")):
            run_argv.append(a)
    return ns, run_argv


def main(argv=None) -> None:
    ns, run_argv = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="harness-cost-") as tmp:
        if ns.report is None and not ns.no_report:
            ns.report = Path(tmp) / "verification.md"
        options = session_options(ns)
        first = None if ns.no_first_line else first_progress_line(run_argv, tmp)
        done = [0]

        def say(line: str) -> None:
            if line.startswith("["):
                done[0] += 1
                if done[0] % 10 == 0:
                    print(f"  {done[0]} scenarios run ...", file=sys.stderr, flush=True)
            elif not line.startswith("wrote"):
                print(f"  {line}", file=sys.stderr, flush=True)

        machine = Machine()
        print("the run, the harness's way, each run's bare training after it ...", file=sys.stderr, flush=True)
        seconds: dict[str, float] = {}
        with machine.part("the run and its bare training"):
            t0 = time.perf_counter()
            # as the CLI runs it (harness.cli cmd_run): the worlds' forkserver started, its preload imported while
            # the session checks the options and models
            start_forkserver()
            session = Session(options, say=say)
            with PairedPool(session.scenarios(), timeout_s=options.matrix.timeout_s) as pool:
                res = session.run(worlds=pool)
                pool.pair_the_rest()  # a last size run side by side: its bare training after every phase
            t_rest = time.perf_counter()  # its worlds closed, as `harness run` closes them before the report
            session.finish()
            wall = time.perf_counter() - t0 - pool.bare_s
        seconds["report"] = time.perf_counter() - t_rest

    ran = [sc for sc in res.scenarios if "ranks" in res.records.get(sc.id, {}) and sc.id in pool.bare]
    machine.print()
    print_figures(res, ran, pool, seconds, wall, first)


class PairedPool(WorldPool):
    """The run's worlds, each run of the matrix (`scenarios`) paired with its bare training (`train_bare`) in the
    world it has just trained in: right after it, or, where the run trains scenarios of that size side by side
    (harness.execute.executor.side_by_side), one at a time after the last of them (when a world of another
    size is asked for, or at `pair_the_rest`). `bare`: scenario id -> {"setup", "steps"}, the slowest rank's;
    `intervals`: (scenario id, start, end) of each bare training (perf_counter), to be taken out of the run's wall
    times; `calls`: the same of each call of the harness's task (harness.train.task), none of which a bare training
    may overlap."""

    def __init__(self, scenarios: list[Scenario], timeout_s: float):
        super().__init__(timeout_s=timeout_s)
        self.matrix = {sc.id: sc for sc in scenarios}
        self.bare: dict[str, dict] = {}
        self._paired: set[str] = set()
        self.intervals: list[tuple[str, float, float]] = []
        self.calls: list[tuple[str, float, float]] = []
        self._waiting: list[Scenario] = []  # run side by side, their bare training not yet
        # CPU this process used while a bare training ran (its thread waits on the world: the run's table-building
        # thread, catching up), which the bare training shared the cores with
        self.parent_cpu_s = 0.0

    def get(self, world_size: int, backend: str = "gloo", lane: int = 0):
        if self._waiting and (self._waiting[0].world_size, self._waiting[0].backend) != (world_size, backend):
            self.pair_the_rest()  # before the worlds they ran in close
        return _PairedWorld(super().get(world_size, backend, lane), self)

    def pair_the_rest(self) -> None:
        while self._waiting:
            sc = self._waiting.pop(0)
            self.train_bare(super().get(sc.world_size, sc.backend, 0), sc)

    def ran(self, world, payload: dict, start: float) -> None:
        """After `world` answered a call of the harness's task that began at `start`: a run of the matrix (its first,
        not a replay's) is paired."""
        run = Scenario(**payload["scenario"]).id
        self.calls.append((run, start, time.perf_counter()))
        sc = self.matrix.get(run)
        if sc is None or sc.id in self._paired or "trace" in payload:
            return
        self._paired.add(sc.id)
        if side_by_side(sc) > 1:  # its neighbours still train: after the last of them
            self._waiting.append(sc)
        else:
            self.train_bare(world, sc)

    def train_bare(self, world, sc: Scenario) -> None:
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            out = world.call(BARE_TASK, dataclasses.asdict(sc))
            self.bare[sc.id] = {k: max(o[k] for o in out) for k in ("setup", "steps")}
        except WorldError:  # it cannot train bare (its rank raised: an unsupported feature): left out
            pass
        finally:
            self.intervals.append((sc.id, t0, time.perf_counter()))
            self.parent_cpu_s += time.process_time() - cpu0

    @property
    def bare_s(self) -> float:
        return sum(b - a for _, a, b in self.intervals)

    def bare_s_between(self, start: float, end: float) -> float:
        """Seconds of bare training within [start, end] (perf_counter)."""
        return sum(max(0.0, min(b, end) - max(a, start)) for _, a, b in self.intervals)


class _PairedWorld:
    """A world of `PairedPool`: its calls, each followed by the pairing of a run that was one."""

    def __init__(self, world, pool: PairedPool):
        self._world, self._pool = world, pool

    def call(self, fn: str, payload: object = None, timeout_s: float | None = None) -> list:
        start = time.perf_counter()
        out = self._world.call(fn, payload, timeout_s=timeout_s)
        if fn == TASK:
            self._pool.ran(self._world, payload, start)
        return out

    def __getattr__(self, name: str):
        return getattr(self._world, name)


class Machine:
    """The whole machine's core-seconds over each part of the invocation (/proc/stat, Linux; nothing elsewhere):
    how much was idle, and how much the host stole (a virtual machine's cores given to another guest: the work of
    this one waited, not idle, and every second of it measured longer). A part with more stolen than another was
    timed on a slower machine."""

    def __init__(self) -> None:
        self.parts: dict[str, tuple[float, CpuSeconds]] = {}
        self.readable = os.path.exists(STAT)

    @contextlib.contextmanager
    def part(self, name: str):
        t, first = time.perf_counter(), cpu_seconds() if self.readable else None
        try:
            yield
        finally:
            if first is not None:
                self.parts[name] = (time.perf_counter() - t, cpu_seconds() - first)

    def print(self) -> None:
        if not self.parts:
            return
        said = [
            f"{name} {wall:.1f} s: {d.idle:.1f} of {d.total:.1f} core-seconds idle, {d.steal:.1f} stolen ({d.steal / d.total:.1%})"
            for name, (wall, d) in self.parts.items()
        ]
        print("the machine (/proc/stat), " + "; ".join(said))


def print_figures(res, ran, pool: PairedPool, seconds, wall, first) -> None:
    bare = pool.bare

    def own(start: float, end: float) -> float:  # a wall time, the bare training within it taken out
        return end - start - pool.bare_s_between(start, end)

    seconds_of = {
        sc.id: own(res.records[sc.id]["ended"] - res.records[sc.id]["seconds"], res.records[sc.id]["ended"])
        for sc in ran
    }
    by_w_bare, by_w_harness, by_w_sum = defaultdict(float), defaultdict(float), defaultdict(float)
    for w in {sc.world_size for sc in ran}:
        runs = [res.records[sc.id] for sc in ran if sc.world_size == w]
        # the wall time of that size's runs: from the first one's start to the last one's end (side by side, the
        # sum of their seconds counts the time they overlap twice; one at a time, the two are the same)
        by_w_harness[w] = own(min(r["ended"] - r["seconds"] for r in runs), max(r["ended"] for r in runs))
    for sc in ran:
        by_w_bare[sc.world_size] += sum(bare[sc.id].values())
        by_w_sum[sc.world_size] += seconds_of.get(sc.id, 0.0)
    for w, s in res.world_start_s.items():  # the bare runs' worlds were started beforehand
        by_w_harness[w] -= s
        by_w_sum[w] -= s
    print(f"{len(ran)} runs ({sum(sc.impl != 'reference' for sc in ran)} of the implementations under test)")
    print(f"{'W':>3} {'runs':>5} {'bare s':>8} {'harness s':>10} {'ratio':>6} {'world start s':>14} {'summed s':>9}")
    for w in sorted(by_w_bare):
        n = sum(sc.world_size == w for sc in ran)
        print(
            f"{w:>3} {n:>5} {by_w_bare[w]:>8.3f} {by_w_harness[w]:>10.3f} {by_w_harness[w] / by_w_bare[w]:>5.2f}x "
            f"{res.world_start_s.get(w, 0.0):>14.3f} {by_w_sum[w]:>9.3f}"
        )
    b, h = sum(by_w_bare.values()), sum(by_w_harness.values())
    print(
        f"all {len(ran):>5} {b:>8.3f} {h:>10.3f} {h / b:>5.2f}x   (the wall time of each size's scenarios less their "
        "worlds' starts against their bare training, one run at a time; summed s: the sum of the scenarios' own "
        "seconds, above the wall time where they ran side by side)"
    )
    print(f"\nthe whole run: {wall:.3f} s wall against {b:.3f} s of bare training: {wall / b:.2f}x")
    print(
        f"the bare training ran {pool.bare_s:.3f} s, taken out of the run's wall times; this process used "
        f"{pool.parent_cpu_s:.3f} s of CPU meanwhile (the run's tables built while its ranks trained), which the bare "
        "training shared the cores with"
    )
    if first is not None:
        seconds_to, said, any_s, first_said = first
        if any_s is not None and first_said:
            print(f"first line {any_s:.2f} s after launch: {first_said[:100]}")
        print(
            f"first progress line {seconds_to:.2f} s after `python -m harness run` was launched (its first scenario done)"
            if seconds_to is not None
            else f"no progress line from `python -m harness run`; it printed:\n{said}"
        )

    # where the difference went
    parts: dict[str, float] = {"bare training (the floor)": b}
    parts["world starts"] = res.phase_s.get("world starts", 0.0)
    # what the parts below count twice where scenarios ran side by side
    parts["scenarios side by side (the time they overlapped)"] = sum(by_w_harness.values()) - sum(by_w_sum.values())
    # the ranks' parts, per world size too (the sums of that size's scenarios' own seconds: where they ran side by
    # side, more than that size's wall time)
    by_w: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    by_w["bare training (the floor)"] = by_w_bare
    between = 0.0
    for sc in ran:
        ranks, w = res.records[sc.id]["ranks"], sc.world_size
        trained = slowest(ranks, "steps") + slowest(ranks, "measured_step")
        plain_steps = max(1, sum(1 for _ in ranks[0]["steps"]) - 1)
        per_step = slowest(ranks, "steps") / plain_steps
        measured_extra = max(0.0, slowest(ranks, "measured_step") - per_step)
        by_w["measured step beyond a plain step (peak tracker, unit timeline)"][w] += measured_extra
        by_w["gradient norm (per step)"][w] += slowest(ranks, "grad_norm")
        by_w["training steps beyond bare (counters, marks)"][w] += (
            trained - slowest(ranks, "grad_norm") - measured_extra - bare[sc.id]["steps"]
        )
        by_w["set-up beyond bare (timeline, checks of the model)"][w] += slowest(ranks, "setup") - bare[sc.id]["setup"]
        for part, what in RANK_PARTS.items():
            by_w[what][w] += slowest(ranks, part)
        between += seconds_of.get(sc.id, 0.0) - slowest(ranks, "total")
    for what, per_w in by_w.items():
        if what not in parts:
            parts[what] = sum(per_w.values())
    parts["between ranks and parent (records sent, world's first call)"] = between - parts["world starts"]
    for name in ("tables", "checks"):
        parts[f"the parent's {name}"] = res.phase_s.get(name, 0.0)
    for name, s in res.phase_s.items():
        if name not in ("scenarios", "tables", "checks", "world starts"):
            parts[f"phase {name}"] = s
    parts["the report and tables written"] = seconds["report"]
    parts["the rest (options, matrix, environment)"] = wall - sum(parts.values())
    sizes = sorted(by_w_bare)
    print(f"\n{'where the run went':<66} {'s':>8} {'of run':>7}" + "".join(f"{f'W = {w}':>9}" for w in sizes))
    for name, s in parts.items():
        per_w = "".join(f"{by_w[name].get(w, 0.0):>9.3f}" for w in sizes) if name in by_w else ""
        print(f"{name:<66} {s:>8.3f} {s / wall:>6.1%}{per_w}")


if __name__ == "__main__":
    main()
