"""Each run's default outputs in a folder of their own (harness.report.runs): reports/runs/<time>/,
reports/latest pointing at the newest; an earlier reports/latest/ folder moved, not replaced; old runs
removed only beyond the newest KEEP_RUNS, and said; --report PATH written exactly there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness import options as opt
from harness.report import runs
from harness.tables.store import OutputError

from . import synthetic_tables as syn


@pytest.fixture(autouse=True)
def in_a_checkout(tmp_path, monkeypatch, fast_plots):
    """A fresh working directory (the default report is relative to it), with stand-in plots."""
    monkeypatch.chdir(tmp_path)


def _default_run() -> tuple[Path, list[str]]:
    session = syn.session_with_result(opt.DEFAULT_REPORT)
    session.write_outputs()
    return session.report, session.notes


def test_each_default_run_keeps_its_own_folder_and_latest_points_at_the_newest():
    first, _ = _default_run()
    first.write_text("the first run's report\n")  # to see that the second run leaves it alone
    second, notes = _default_run()
    assert first != second and first.parent.parent == second.parent.parent == runs.RUNS
    assert first.read_text() == "the first run's report\n"
    assert (second.parent / "verification_tables" / "run.json").is_file()
    assert runs.LATEST.is_symlink() and runs.LATEST.resolve() == second.parent.resolve()
    assert (runs.LATEST / "verification.md").read_text() == second.read_text()
    assert notes == [f"{runs.LATEST} -> {second.parent}"]


def test_a_reports_latest_folder_of_an_earlier_version_is_moved_into_runs_not_replaced():
    runs.LATEST.mkdir(parents=True)
    (runs.LATEST / "verification.md").write_text("written before runs had folders\n")
    report, notes = _default_run()
    [earlier] = [f for f in runs.RUNS.iterdir() if f != report.parent]
    assert (earlier / "verification.md").read_text() == "written before runs had folders\n"
    assert notes[0] == f"moved the earlier {runs.LATEST}/ to {earlier}/"
    assert runs.LATEST.resolve() == report.parent.resolve()


def test_only_the_newest_runs_are_kept_and_each_removal_is_said():
    old = [runs.RUNS / f"20000101-0000{i:02d}" for i in range(runs.KEEP_RUNS)]
    for folder in old:
        folder.mkdir(parents=True)
    (runs.RUNS / "mine").mkdir()  # not a run folder: never touched
    report, notes = _default_run()
    kept = sorted(p.name for p in runs.RUNS.iterdir())
    assert kept == sorted([f.name for f in old[1:]] + [report.parent.name, "mine"])
    assert notes[-1] == f"removed {old[0]} (the newest {runs.KEEP_RUNS} runs are kept)"


def test_an_explicit_report_path_is_written_exactly_there(tmp_path):
    report = tmp_path / "elsewhere" / "r.md"
    session = syn.session_with_result(report)
    session.write_outputs()
    assert session.report == report and report.is_file() and session.notes == []
    assert not Path("reports").exists()


def test_a_default_run_whose_write_fails_leaves_no_run_folder_and_latest_as_it_was(monkeypatch):
    first, _ = _default_run()

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OutputError):
        _default_run()
    assert [p for p in runs.RUNS.iterdir()] == [first.parent]
    assert runs.LATEST.resolve() == first.parent.resolve()
