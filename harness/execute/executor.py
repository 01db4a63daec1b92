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
import itertools
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from harness.adapters import load_adapter
from harness.adapters.base import AdapterError, missing_capability
from harness.core.children import usable_cpus
from harness.core.features import parts
from harness.core.scenario import Scenario, ckpt_step
from harness.execute.worker import root_cause
from harness.execute.world import SIGNAL_SLICE_S, RankFailed, WorldError, WorldHung, WorldPool, preload

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
    """`ScenarioPool` over a `WorldPool`: consecutive scenarios of one (world size, backend) share a world; where a
    world's ranks fit the cores several worlds of that size run scenarios side by side (`lanes`)."""

    def __init__(self, pool: WorldPool, timeout_s: float):
        self.pool, self.timeout_s = pool, timeout_s
        self._busy: dict[int, object] = {}  # lane -> the world it waits for (begin)

    @property
    def worlds_started(self) -> int:
        return self.pool.worlds_started

    def lanes(self, sc: Scenario) -> int:
        """How many scenarios like `sc` run at once (`side_by_side`)."""
        return side_by_side(sc)

    def run_scenario(self, sc: Scenario, payload: dict) -> dict:
        return self.begin(sc, payload)()

    def begin(self, sc: Scenario, payload: dict, lane: int = 0) -> Callable[[], dict]:
        """Gives `sc`'s task to the world of `lane` (started here where it is not running: in the thread that owns
        the pool, where a Ctrl-C may interrupt the start) and returns what waits for the ranks' replies and makes
        the record (called on any thread)."""
        try:
            world = self.pool.get(sc.world_size, sc.backend, lane)
        except WorldError as e:
            failed = {"error": str(e), "failed_rank": failed_rank(e)}
            return lambda: failed
        self._busy[lane] = world

        def record() -> dict:
            try:
                return {"ranks": world.call(TASK, payload, timeout_s=self.timeout_s)}
            except WorldError as e:
                return {"error": str(e), "failed_rank": failed_rank(e)}
            finally:
                self._busy.pop(lane, None)

        return record

    def abandon(self) -> None:
        """Kill the worlds whose replies are still awaited (the run stops: nothing will read them)."""
        for world in list(self._busy.values()):
            world.kill()


def side_by_side(sc: Scenario) -> int:
    """How many scenarios like `sc` may run at once, each in a world of its own: the cores over its ranks, at
    most MAX_LANES; and two where a world of several ranks fits the cores just once. Its ranks wait on each
    other at every collective and leave their cores idle meanwhile; the second world's ranks use them (on 2
    cores, the main job's worlds of 2: reports/performance.md). One on GPUs (a second world would share a
    device whose peak memory the first measures)."""
    if sc.device_type != "cpu":
        return 1
    fit = usable_cpus() // sc.world_size
    return max(1, min(MAX_LANES, 2 if sc.world_size > 1 and fit == 1 else fit))


MAX_LANES = 4  # worlds of one size side by side at most (each a copy of the model and of torch in memory)


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
    included), in ascending size again. Where the pool has lanes (`ReusedWorlds.lanes`), the scenarios of one
    world size run that many at a time, as long as their ranks together are no more than the largest world of the
    run (their progress lines in the order they finish). `on_record(id, record)`:
    each record as it is made (the tables built while the next scenarios train: harness.tables.build.TableBuilder)."""
    results: dict[str, dict] = {}
    order = sorted(scenarios, key=lambda s: (s.backend, s.saver() is not None, s.world_size))
    savers = {s.saver() for s in scenarios if s.saver() is not None and not unsupported(s)}
    done = 0

    def finished(sc: Scenario, record: dict | None, seconds: float) -> None:
        nonlocal done
        done += 1
        if record is not None:
            # its seconds as its progress line shows them; when it ended (scenarios side by side overlap)
            results[sc.id] = {**record, "seconds": seconds, "ended": time.perf_counter()}
            if on_record is not None:
                on_record(sc.id, results[sc.id])
        if progress is not None:
            progress(done, len(order), sc, seconds)

    lanes = getattr(pool, "lanes", None)
    # never more ranks at once than the run's largest world, which harness.limits checked fits this machine's memory
    most_ranks = max((sc.world_size for sc in order), default=1)
    for _, group in itertools.groupby(order, key=lambda s: (s.backend, s.saver() is not None, s.world_size)):
        group = list(group)
        n = min(len(group), lanes(group[0]), most_ranks // group[0].world_size) if callable(lanes) else 1
        if n > 1:
            _side_by_side(group, n, pool, lambda sc: payload_of(sc, snapshot_dir, savers), finished)
            continue
        for sc in group:
            t0 = time.perf_counter()
            why = unsupported(sc)
            record = {"unsupported": why} if why else pool.run_scenario(sc, payload_of(sc, snapshot_dir, savers))
            finished(sc, record, time.perf_counter() - t0)
    return results


def _side_by_side(group: list[Scenario], lanes: int, pool, payload, finished) -> None:
    """The scenarios of `group`, `lanes` at a time, each lane a world of its own: a scenario is given to its world
    on this thread (`pool.begin`, which may start the world), its ranks' replies awaited on a thread of the lane's.
    A failure that ends the run (raised by a world) is raised here; a Ctrl-C kills the worlds still awaited."""
    replies: queue.SimpleQueue = queue.SimpleQueue()
    waiting = list(group)
    free, busy = list(range(lanes)), {}  # lane -> (scenario, start)

    def await_on_thread(lane: int, record: Callable[[], dict]) -> None:
        try:
            replies.put((lane, record(), None))
        except BaseException as e:  # noqa: BLE001 (raised again on the pool's thread)
            replies.put((lane, None, e))

    try:
        while waiting or busy:
            while waiting and free:
                sc, lane, t0 = waiting.pop(0), free.pop(0), time.perf_counter()
                why = unsupported(sc)
                if why:
                    free.append(lane)
                    finished(sc, {"unsupported": why}, time.perf_counter() - t0)
                    continue
                busy[lane] = (sc, t0)
                record = pool.begin(sc, payload(sc), lane)
                threading.Thread(target=await_on_thread, args=(lane, record), name=f"lane{lane}", daemon=True).start()
            if not busy:
                continue
            lane, record, error = _next_reply(replies)
            sc, t0 = busy.pop(lane)
            free.append(lane)
            if error is not None:
                raise error
            finished(sc, record, time.perf_counter() - t0)
    except BaseException:
        pool.abandon()
        raise


def _next_reply(replies: queue.SimpleQueue) -> tuple:
    """The next lane's reply, waited for in short slices (a Ctrl-C is raised between them on every platform)."""
    while True:
        try:
            return replies.get(timeout=SIGNAL_SLICE_S)
        except queue.Empty:
            continue
