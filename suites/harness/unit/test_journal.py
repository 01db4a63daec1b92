"""A journaled matrix resumes where it stopped (harness.execute.journal): nothing recorded runs twice, nothing
cut short is taken for a result, and the verdicts of a resumed run are those of a run made at once."""

from __future__ import annotations

import pytest

from harness.core.scenario import Scenario, build_matrix
from harness.execute.executor import execute
from harness.execute.journal import Journal, JournalMismatch
from harness.phases import run_matrix


class CountingPool:
    """A ScenarioPool that makes a record per scenario, counting the calls; Ctrl-C at call number `stop_at`."""

    worlds_started = 0

    def __init__(self, stop_at: int | None = None):
        self.calls, self.stop_at = [], stop_at

    def run_scenario(self, sc, payload):
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append(sc.id)
        return {"error": "boom", "failed_rank": 1} if sc.world_size == 2 else {"ranks": [{"id": sc.id}]}


def _cells():
    return [Scenario("fsdp_impl", "mlp", w, "replicated", "adamw", steps=2) for w in (1, 2, 4)]


def test_an_interrupted_matrix_resumes_without_running_a_recorded_scenario_again(tmp_path):
    from harness.execute.journal import Journaled

    journal = Journal(tmp_path / "j", "abc123")
    stopped = Journaled(CountingPool(stop_at=2), journal)
    with pytest.raises(KeyboardInterrupt):
        execute(_cells(), snapshot_dir=journal.snapshots, pool=stopped)
    assert stopped.pool.calls == [c.id for c in _cells()[:2]] and len(journal) == 2  # the cut one is not recorded
    again = Journaled(CountingPool(), Journal(tmp_path / "j", "abc123"))
    records = execute(_cells(), snapshot_dir=journal.snapshots, pool=again)
    assert again.pool.calls == [_cells()[2].id], "a recorded scenario ran again, or the cut one did not"
    assert again.read_back == 2 and again.read_back_s >= 0
    at_once = execute(_cells(), snapshot_dir=journal.snapshots, pool=CountingPool())
    assert untimed(records) == untimed(at_once)  # as if run at once (each record's seconds and end apart)
    assert all(r["seconds"] >= 0 for r in records.values())
    assert records[_cells()[1].id]["error"] == "boom", "a failed scenario is a result, kept as it came"


def untimed(records: dict) -> dict:
    return {sid: {k: v for k, v in r.items() if k not in ("seconds", "ended")} for sid, r in records.items()}


def test_a_journal_started_by_other_code_is_refused(tmp_path):
    Journal(tmp_path / "j", "abc123")
    with pytest.raises(JournalMismatch, match="abc123"):
        Journal(tmp_path / "j", "def456 + changes")


def test_a_real_matrix_read_back_from_its_journal_gives_the_same_verdicts(tmp_path, kept_worlds):
    """Real ranks, real snapshots: the second run starts no world and reads every record and snapshot back."""
    cells = build_matrix(("fsdp_impl",), ["mlp"], [1, 2], ("replicated", "split"), ("sgd",), steps=2)
    first = run_matrix(cells, pool=kept_worlds, journal=Journal(tmp_path / "j", "abc123"))
    assert first.verdicts and not first.failed, [str(v) for v in first.failed]

    class NoWorlds:
        worlds_started = 0

        def run_scenario(self, sc, payload):
            raise AssertionError(f"{sc.id} ran again")

    again = run_matrix(cells, pool=NoWorlds(), journal=Journal(tmp_path / "j", "abc123"))
    assert [(v.scenario, v.check, v.status, v.measured) for v in again.verdicts] == [
        (v.scenario, v.check, v.status, v.measured) for v in first.verdicts
    ]
    assert again.wall_s >= 0.5 * first.wall_s  # the time the records took to make is counted (runs dominate)
