"""Runs a scenario matrix: groups scenarios by world, reuses each world for its whole group."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from harness.checks.numeric import run_checks, verdict_table
from harness.core.environment import environment
from harness.core.policy import Bounds
from harness.core.scenario import Scenario
from harness.core.verdict import Verdict
from harness.execute.worker import root_cause
from harness.execute.world import RankFailed, WorldError, WorldHung, WorldPool
from harness.tables.build import build_tables

TASK = "harness.train.task:run_scenario"


@dataclass
class RunResult:
    scenarios: list[Scenario]
    tables: dict[str, pd.DataFrame]
    verdicts: list[Verdict]
    env: dict
    wall_s: float
    worlds_started: int = 0
    records: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.passed]


def failed_rank(e: WorldError) -> int | None:
    """The rank a world failure started on: the one whose own error it was, or the first silent one."""
    if isinstance(e, RankFailed) and e.tracebacks:
        return root_cause(e.tracebacks)
    if isinstance(e, WorldHung) and e.missing:
        return min(e.missing)
    return None


def execute(scenarios: list[Scenario], *, snapshot_dir: Path, pool: WorldPool,
            timeout_s: float = 300.0, progress: Callable[[int, int, Scenario, float], None] | None = None) -> dict:
    """scenario id -> {"ranks": [record per rank]} or {"error": message}. Worlds in ascending size."""
    results: dict[str, dict] = {}
    order = sorted(scenarios, key=lambda s: (s.backend, s.world_size))
    for i, sc in enumerate(order):
        t0 = time.perf_counter()
        payload = {"scenario": dataclasses.asdict(sc), "snapshot_dir": str(snapshot_dir)}
        try:
            world = pool.get(sc.world_size, sc.backend)
            results[sc.id] = {"ranks": world.run(TASK, payload, timeout_s=timeout_s)}
        except WorldError as e:
            results[sc.id] = {"error": str(e), "failed_rank": failed_rank(e)}
        if progress is not None:
            progress(i + 1, len(order), sc, time.perf_counter() - t0)
    return results


def run_matrix(scenarios: list[Scenario], *, pool: WorldPool | None = None, timeout_s: float = 300.0,
               bounds: Bounds = Bounds(), progress=None) -> RunResult:
    t0 = time.perf_counter()
    own_pool = pool is None
    pool = pool or WorldPool(timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="fsdp-harness-") as tmp:
        try:
            records = execute(scenarios, snapshot_dir=Path(tmp), pool=pool, timeout_s=timeout_s, progress=progress)
        finally:
            if own_pool:
                pool.close()
        tables = build_tables(scenarios, records)
    verdicts = run_checks(tables, bounds)
    tables["verdicts"] = verdict_table(verdicts)
    backend = scenarios[0].backend if scenarios else "gloo"
    return RunResult(scenarios, tables, verdicts, environment(backend), time.perf_counter() - t0,
                     getattr(pool, "worlds_started", 0), records)
