"""A matrix that resumes where it stopped: every scenario's record kept on disk as soon as it is made.

A sweep part of the slow tier (every feature of one model through the full matrix: a long run,
reports/performance.md#mutation-score-and-false-alarm-sweeps) must not be all or nothing: a session that ends
mid-part would lose it. With a `Journal`, `run_matrix` keeps the ranks' snapshots in the journal's folder
instead of a temp dir, and each scenario's record beside them when the scenario is done; run again on the same
folder, the scenarios already recorded are read back instead of run, and tables and verdicts are built from
the whole as if it had run at once (they only read records and snapshots).

What is recorded is what the pool returned: a failed scenario too (its error is a result; rerunning until it
passes would hide it). A scenario that an interrupt cut short raised out of the pool (Ctrl-C, SIGTERM and SIGHUP
unwind as KeyboardInterrupt, harness.execute.world) and was not recorded: it runs again. A journal belongs
to the code that started it: run by other code (`made_with` differs) it is refused, not mixed in.
"""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

from harness.core.scenario import Scenario


class JournalMismatch(Exception):
    pass


class Journal:
    def __init__(self, root: Path, made_with: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        stamp = self.root / "made_with.txt"
        if stamp.exists() and stamp.read_text() != made_with:
            raise JournalMismatch(
                f"{self.root} was started by {stamp.read_text()!r}, this is {made_with!r}: "
                "run that code on it, or move it away to start afresh"
            )
        stamp.write_text(made_with)
        self.snapshots = self.root / "snapshots"
        self.snapshots.mkdir(exist_ok=True)
        self._records = self.root / "records"
        self._records.mkdir(exist_ok=True)

    def _path(self, scenario_id: str) -> Path:
        return self._records / f"{scenario_id}.pkl"

    def get(self, scenario_id: str) -> tuple[dict, float] | None:
        """The scenario's record and the seconds it took to make, or None if it is not recorded."""
        path = self._path(scenario_id)
        if not path.exists():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def put(self, scenario_id: str, record: dict, seconds: float) -> None:
        path = self._path(scenario_id)
        part = path.with_name(path.name + ".part")  # written whole, then put in place: a stop leaves no half
        with open(part, "wb") as f:
            pickle.dump((record, seconds), f)
            f.flush()
            os.fsync(f.fileno())
        part.replace(path)

    def __len__(self) -> int:
        return sum(1 for _ in self._records.glob("*.pkl"))


class Journaled:
    """A ScenarioPool that reads a scenario's record from the journal if it is there, else runs it with `pool`
    and records what came back. `read_back_s`: what the records read back took to make, for a run's wall time."""

    def __init__(self, pool, journal: Journal):
        self.pool, self.journal = pool, journal
        self.read_back, self.read_back_s = 0, 0.0

    @property
    def worlds_started(self) -> int:
        return self.pool.worlds_started

    def run_scenario(self, sc: Scenario, payload: dict) -> dict | None:
        kept = self.journal.get(sc.id)
        if kept is not None:
            self.read_back += 1
            self.read_back_s += kept[1]
            return kept[0]
        t0 = time.perf_counter()
        record = self.pool.run_scenario(sc, payload)
        if record is not None:
            self.journal.put(sc.id, record, time.perf_counter() - t0)
        return record
