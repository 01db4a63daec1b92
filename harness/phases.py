"""The phases of a verification run, in order, on one pool of worlds.

    matrix      every scenario on its ranks (harness.execute), the records made into tables (harness.tables)
                and judged (harness.checks)
    replay      a split run whose trajectory alone left the full batch's, replayed step by step before it is
                blamed (harness.localize.replayed)
    localise    the first N scenarios with a failing numeric verdict, replayed with their yardstick, every op
                traced (harness.localize.auto; --localize N)
    per-sample  per-sample gradient norms (harness.per_sample; --per-sample)
    invariant   the batch-invariant tier (harness.invariant; --invariant)
    gate        the comparison with a baseline (harness.gate; --baseline)

after which the session (harness.session) writes the outputs: the report, the tables and a saved baseline.

Every phase that puts work on ranks puts it on the run's one `WorldPool`, made with the run's
`--scenario-timeout`: a rank task of any phase that does not answer within it fails that task with the ranks'
stacks, and the world is rebuilt for the next. A Ctrl-C in any phase is the pool's to unwind (the worlds are
killed) and the entry point's to report. Under torchrun the matrix runs in the job's processes
(harness.execute.torchrun) and the phases that start worlds of their own do not apply.

Phases add tables and verdicts to the run's `RunResult`; the verdict table is made from the verdicts once,
after the last phase (`finish_tables`)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.checks.registry import run_checks, verdict_table
from harness.core.environment import environment
from harness.core.policy import Bounds
from harness.core.scenario import DATA_MODES, Scenario
from harness.core.verdict import Verdict
from harness.execute.executor import Progress, ReusedWorlds, ScenarioPool, execute
from harness.execute.world import WorldPool
from harness.localize.auto import localise_failures
from harness.localize.replayed import replay_crossings
from harness.options import SessionOptions
from harness.tables.build import TableBuilder

PER_SAMPLE_MODELS = ("mlp",)


@dataclass
class RunResult:
    scenarios: list[Scenario]
    tables: dict[str, pd.DataFrame]
    verdicts: list[Verdict]
    env: dict
    wall_s: float
    worlds_started: int = 0
    records: dict = field(default_factory=dict)
    # seconds per part of the run: the matrix's scenarios, tables and checks, then each later phase by name
    # (harness.bench.harness_cost says where a run's time went from them)
    phase_s: dict = field(default_factory=dict)
    # world size -> seconds its worlds took to start, inside its first scenario's seconds (harness.bench.harness_cost)
    world_start_s: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.passed]


@dataclass
class Run:
    """What the phases of one run share: its options, the scenarios, the one pool of worlds (None under torchrun),
    where progress goes, the baseline the gate compares with, and the result the phases build up."""

    options: SessionOptions
    scenarios: list[Scenario]
    pool: WorldPool | None
    say: Callable[[str], None] = lambda line: None
    progress: Progress | None = None
    baseline: object | None = None  # harness.gate.baseline.Baseline
    result: RunResult | None = None  # None on torchrun ranks other than 0 (rank 0 judges)

    @property
    def in_worlds(self) -> bool:
        return self.pool is not None


@dataclass(frozen=True)
class Phase:
    name: str
    applies: Callable[[Run], bool]
    run: Callable[[Run], None]


# The phases #


def _matrix(run: Run) -> None:
    m = run.options.matrix
    if run.in_worlds:
        run.result = _records_judged(
            run.scenarios, ReusedWorlds(run.pool, m.timeout_s), m.bounds, run.progress, ranks_elsewhere=True
        )
    else:
        run.result = run_matrix_under_torchrun(
            run.scenarios, timeout_s=m.timeout_s, bounds=m.bounds, progress=run.progress, verdict_table_too=False
        )


def _replay(run: Run) -> None:
    res = run.result
    res.verdicts = replay_crossings(res.scenarios, res.verdicts, run.pool, run.options.matrix.bounds, say=run.say)


def _localise(run: Run) -> None:
    localise_failures(run.result, run.options.localize, pool=run.pool, say=run.say)


def _per_sample(run: Run) -> None:
    from harness.per_sample.run import run_per_sample

    run.say("per-sample gradient norms ...")
    tables, verdicts = run_per_sample(
        models=PER_SAMPLE_MODELS,
        world_sizes=tuple(run.options.matrix.world_sizes),
        localise=run.options.localize,
        pool=run.pool,
    )
    run.result.tables.update(tables)
    run.result.verdicts.extend(verdicts)


def _invariant(run: Run) -> None:
    from harness.invariant.run import run_invariant
    from harness.invariant.task import FEATURES

    run.say("batch-invariant tier ...")
    m = run.options.matrix
    features = [f for f in m.features if f in FEATURES]
    left = [f for f in m.features if f not in FEATURES]
    if left:
        run.say(
            f"the batch-invariant tier runs {', '.join(FEATURES)}; not {', '.join(left)} (harness/invariant/task.py)"
        )
    tables, verdicts = run_invariant(
        m.impls,
        m.models,
        m.world_sizes,
        DATA_MODES,
        m.optimizers,
        steps=m.steps,
        seed=m.seeds[0],
        lr=m.lr,
        global_batch=m.global_batch,
        features=features or ("plain",),
        pool=run.pool,
    )
    run.result.tables.update(tables)
    run.result.verdicts.extend(verdicts)


def _gate(run: Run) -> None:
    from harness.gate.compare import compare

    o, res = run.options, run.result
    res.verdicts.extend(compare(res.tables, run.baseline, o.gate, env=res.env, strict=o.gate_strict))


PHASES = (
    Phase("matrix", lambda run: True, _matrix),
    Phase("replay", lambda run: run.in_worlds, _replay),
    Phase("localise", lambda run: run.in_worlds and run.options.localize > 0, _localise),
    Phase("per-sample", lambda run: run.in_worlds and run.options.per_sample, _per_sample),
    Phase("invariant", lambda run: run.in_worlds and run.options.invariant, _invariant),
    Phase("gate", lambda run: run.baseline is not None, _gate),
)


def run_phases(run: Run, phases: tuple[Phase, ...] = PHASES) -> RunResult | None:
    """Each phase that applies, in order; the result with its verdict table made once (None on a torchrun rank
    other than 0)."""
    t0 = time.perf_counter()
    for phase in phases:
        if phase.applies(run):
            t = time.perf_counter()
            phase.run(run)
            if run.result is not None and phase.name != "matrix":  # the matrix times its own parts
                run.result.phase_s[phase.name] = time.perf_counter() - t
        if run.result is None:
            return None
    finish_tables(run.result)
    run.result.wall_s = time.perf_counter() - t0
    return run.result


def finish_tables(result: RunResult) -> None:
    """The verdict table, from the verdicts every phase gave."""
    result.tables["verdicts"] = verdict_table(result.verdicts)


# The matrix on its own #


def _records_judged(
    scenarios: list[Scenario],
    pool: ScenarioPool,
    bounds: Bounds,
    progress: Progress | None,
    snapshot_dir: str | Path | None = None,
    read_back_s: float = 0.0,
    *,
    ranks_elsewhere: bool,
) -> RunResult:
    """Every scenario on `pool`, the tables built and the checks run (no verdict table yet). `ranks_elsewhere`: the
    ranks are other processes (worlds), so the tables are built on a thread of this one while they train (not
    beside a rank's own training under torchrun, whose census would count them)."""
    t0 = time.perf_counter()
    own_dir = tempfile.TemporaryDirectory(prefix="fsdp-harness-") if snapshot_dir is None else None
    phase_s = {}
    with own_dir or contextlib.nullcontext(snapshot_dir) as snapshots:
        # the tables are built while the ranks train (the parent's cores are idle much of that time); what is left
        # when the last scenario is done is the tables' part of the run
        builder = TableBuilder(scenarios, background=ranks_elsewhere)
        try:
            records = execute(scenarios, snapshot_dir=snapshots, pool=pool, progress=progress, on_record=builder.add)
            phase_s["scenarios"] = time.perf_counter() - t0
            tables = builder.finish()
        finally:
            builder.close()
        phase_s["tables"] = time.perf_counter() - t0 - phase_s["scenarios"]
    t = time.perf_counter()
    verdicts = run_checks(tables, bounds)
    phase_s["checks"] = time.perf_counter() - t
    backend = scenarios[0].backend if scenarios else "gloo"
    return RunResult(
        scenarios,
        tables,
        verdicts,
        environment(backend),
        time.perf_counter() - t0 + read_back_s,
        pool.worlds_started,
        records,
        phase_s,
    )


def run_matrix(
    scenarios: list[Scenario],
    *,
    pool: WorldPool | ScenarioPool | None = None,
    timeout_s: float = 300.0,
    bounds: Bounds = Bounds(),
    progress: Progress | None = None,
    snapshot_dir: str | Path | None = None,
    say=lambda line: None,
    journal=None,
) -> RunResult:
    """The matrix and replay phases, for a caller that wants the judged matrix alone (tests, benches, the
    mutation sweep): every scenario run, the tables built, the checks run, and in worlds (a WorldPool) a split
    run whose trajectory alone left the full batch's replayed step by step before it is blamed. `pool`: a
    WorldPool to reuse (it stays open), any other ScenarioPool, or None for a WorldPool of this call's own.
    `snapshot_dir`: where the ranks write full-parameter snapshots (a temp dir of this call's own when None).
    `say`: a line of progress (the replays). `journal`: a harness.execute.journal.Journal that keeps the
    snapshots and every scenario's record as it is made, and gives back those of a run that stopped
    (snapshot_dir is then the journal's)."""
    t0 = time.perf_counter()
    own_pool = pool is None
    world_pool = WorldPool(timeout_s=timeout_s) if own_pool else pool
    scenario_pool = ReusedWorlds(world_pool, timeout_s) if isinstance(world_pool, WorldPool) else world_pool
    if journal is not None:
        from harness.execute.journal import Journaled

        scenario_pool, snapshot_dir = Journaled(scenario_pool, journal), journal.snapshots
    try:
        res = _records_judged(
            scenarios, scenario_pool, bounds, progress, snapshot_dir, ranks_elsewhere=isinstance(world_pool, WorldPool)
        )
        if isinstance(world_pool, WorldPool):
            res.verdicts = replay_crossings(scenarios, res.verdicts, world_pool, bounds, say=say)
    finally:
        if own_pool:
            world_pool.close()
    finish_tables(res)
    res.worlds_started = scenario_pool.worlds_started
    res.wall_s = time.perf_counter() - t0 + (scenario_pool.read_back_s if journal is not None else 0.0)
    return res


def run_matrix_under_torchrun(
    scenarios: list[Scenario],
    *,
    timeout_s: float = 300.0,
    bounds: Bounds = Bounds(),
    progress: Progress | None = None,
    verdict_table_too: bool = True,
) -> RunResult | None:
    """Run `scenarios` in the torchrun job this process belongs to (every process of the job calls it with the
    same scenarios): the judged RunResult on rank 0, None on the other ranks."""
    from harness.execute.torchrun import torchrun_job

    t0 = time.perf_counter()
    with torchrun_job(scenarios, timeout_s=timeout_s) as job:
        if job is None:
            return None
        res = _records_judged(scenarios, job.pool, bounds, progress, job.snapshot_dir, ranks_elsewhere=False)
    if verdict_table_too:
        finish_tables(res)
    res.wall_s = time.perf_counter() - t0
    return res
