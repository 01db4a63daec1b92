"""Runs a scenario matrix's rank work: one loop over the scenarios, each scenario's outcome a record (the tables
and verdicts are made from the records by harness.phases).

Where the ranks live is the pool's business. Two pools keep one contract (`ScenarioPool`):

- `ReusedWorlds` (here): forkserver worlds started by the harness, one per world size, reused for
  every scenario of that size (`harness.execute.world.WorldPool`);
- `TorchrunPool` (`harness.execute.torchrun`): the processes of a job that torchrun launched,
  subgroups of ranks 0..w-1 per world size.

Either way a scenario's outcome is a record: ``{"ranks": [record per rank]}`` when every rank
finished, else ``{"error": message, "failed_rank": rank or None}``. A failing scenario never raises
out of the pool; the next scenario runs on a rebuilt world. A scenario whose feature needs an adapter
method the adapter lacks is not run: ``{"unsupported": reason}``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from harness.adapters import load_adapter
from harness.adapters.base import AdapterError, missing_capability
from harness.core.features import parts
from harness.core.scenario import Scenario, ckpt_step
from harness.execute.worker import root_cause
from harness.execute.world import RankFailed, WorldError, WorldHung, WorldPool, preload

# what every scenario's workers import: the training task, the built-in adapters and fsdp_impl, preloaded
# once in the forkserver instead of imported again by each new world's workers (reports/performance.md#world-start)
preload("harness.train.task", "harness.adapters", "fsdp_impl")

TASK = "harness.train.task:train_scenario"
Progress = Callable[[int, int, Scenario, float], None]


class ScenarioPool(Protocol):
    """Runs one scenario's ranks. `run_scenario` returns the scenario's record in the process that
    collects results and None in any other; it does not raise for a failure of the scenario."""

    worlds_started: int

    def run_scenario(self, sc: Scenario, payload: dict) -> dict | None: ...


class ReusedWorlds:
    """`ScenarioPool` over a `WorldPool`: consecutive scenarios of one (world size, backend) share a world."""

    def __init__(self, pool: WorldPool, timeout_s: float):
        self.pool, self.timeout_s = pool, timeout_s

    @property
    def worlds_started(self) -> int:
        return self.pool.worlds_started

    def run_scenario(self, sc: Scenario, payload: dict) -> dict:
        try:
            world = self.pool.get(sc.world_size, sc.backend)
            return {"ranks": world.call(TASK, payload, timeout_s=self.timeout_s)}
        except WorldError as e:
            return {"error": str(e), "failed_rank": failed_rank(e)}


def unsupported(sc: Scenario) -> str | None:
    """Why `sc`'s adapter cannot run its feature, or None (plain scenarios need no look at the adapter)."""
    if not parts(sc.feature):
        return None
    adapter = _adapter(sc.impl)
    return None if adapter is None else missing_capability(adapter, sc.feature, sc.optimizer)


@functools.cache
def _adapter(impl: str):
    """One adapter per implementation name, to look at its capabilities (None: it does not load, and
    the scenario itself will fail with the adapter's own message)."""
    try:
        return load_adapter(impl)
    except AdapterError:
        return None


def payload_of(sc: Scenario, snapshot_dir, savers: set[Scenario]) -> dict:
    """What the rank task gets: the scenario, where snapshots go, and for ckpt where the checkpoint is
    saved (a saver: after which step) or read (a resumed run)."""
    payload = {"scenario": dataclasses.asdict(sc), "snapshot_dir": str(snapshot_dir)}
    if sc in savers:
        payload["save_checkpoint_at"] = ckpt_step(sc.steps)
    if sc.saver() is not None:
        payload["checkpoint_of"] = sc.saver().id
    return payload


def failed_rank(e: WorldError) -> int | None:
    """The rank a world failure started on: the one whose own error it was, or the first silent one."""
    if isinstance(e, RankFailed) and e.tracebacks:
        return root_cause(e.tracebacks)
    if isinstance(e, WorldHung) and e.missing:
        return min(e.missing)
    return None


def execute(
    scenarios: list[Scenario],
    *,
    snapshot_dir: str | Path,
    pool: ScenarioPool,
    progress: Progress | None = None,
    on_record: Callable[[str, dict], None] | None = None,
) -> dict:
    """scenario id -> record, for the records this process collects. Worlds in ascending size, so that
    each world is started once; runs resumed from a checkpoint come after every run (their savers
    included), in ascending size again. `on_record(id, record)`: each record as it is made (the tables built
    while the next scenarios train: harness.tables.build.TableBuilder)."""
    results: dict[str, dict] = {}
    order = sorted(scenarios, key=lambda s: (s.backend, s.saver() is not None, s.world_size))
    savers = {s.saver() for s in scenarios if s.saver() is not None and not unsupported(s)}
    for i, sc in enumerate(order):
        t0 = time.perf_counter()
        payload = payload_of(sc, snapshot_dir, savers)
        why = unsupported(sc)
        record = {"unsupported": why} if why else pool.run_scenario(sc, payload)
        seconds = time.perf_counter() - t0
        if record is not None:
            results[sc.id] = {**record, "seconds": seconds}  # as its progress line shows it
            if on_record is not None:
                on_record(sc.id, results[sc.id])
        if progress is not None:
            progress(i + 1, len(order), sc, seconds)
    return results
