"""One session behind both entries: `python -m harness run` and the pytest plugin give the same
tables, verdicts and report for the same options; the matrix runs once under pytest-xdist; `-k`
runs only what the selected tests need; output never lands on the committed reports, and each run's
default output has a folder of its own.

Each test runs the entry point in a subprocess on a small slice (mlp, W 1 and 2, 2 steps), in a
fresh working directory, so the default output location is the one a user gets. The CLI run and the
pytest run of that slice (under xdist, as the README's test command runs it) are each made once (module fixtures) and read by every test about
them; both compare with the committed baseline, which a 2-step run shares no figure with.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from harness.tables.store import load_tables

# the CI tier (--ci; .ci/run runs it): CLI and nested pytest runs, each a process with worlds of its own
pytestmark = pytest.mark.ci

ROOT = Path(__file__).resolve().parents[3]
SLICE = [
    "--world-sizes",
    "2",
    "--impl",
    "fsdp_impl",
    "--models",
    "mlp",
    "--optimizers",
    "sgd",
    "--steps",
    "2",
    "--data-modes",
    "replicated",
]
REPORT = Path("reports/latest/verification.md")


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    # one thread per process, as every rank has: a single-threaded pytest forks its forkserver too
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _slice_but(extra) -> list[str]:
    """SLICE without the options `extra` gives again (an option given twice is a usage error)."""
    pairs = [SLICE[i : i + 2] for i in range(0, len(SLICE), 2)]
    return [tok for pair in pairs if pair[0] not in extra for tok in pair]


def _pytest_args(*extra: str) -> list[str]:
    return [
        str(ROOT / "suites" / "harness" / "end_to_end" / "test_equivalence.py"),
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(ROOT),
        *_slice_but(extra),
        *extra,
    ]


def _pytest(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return _run(["-m", "pytest", *_pytest_args(*extra)], cwd)


def _verdicts(folder: Path) -> set[tuple]:
    tables, _ = load_tables(folder / "reports" / "latest" / "verification_tables")
    v = tables["verdicts"]
    return set(zip(v["check"], v["scenario"], v["status"]))


GATED = ("--baseline", "default")  # the committed baseline ran 10 steps: the gate compares nothing


def _with_baselines(folder: Path) -> Path:
    shutil.copytree(ROOT / "reports" / "baselines", folder / "reports" / "baselines")
    return folder


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory) -> Path:
    d = _with_baselines(tmp_path_factory.mktemp("cli"))
    proc = _run(["-m", "harness", "run", *SLICE, *GATED], d)
    assert proc.returncode == 0, proc.stderr
    return d


XDIST = ("-n", "2", "--dist", "loadfile")  # as in the README's test command


@pytest.fixture(scope="module")
def xdist_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The slice through pytest as the README's test command runs it (xdist, gated): the run that is
    compared with the CLI's. pytest without xdist makes the -k and NOT RUN runs below."""
    d = _with_baselines(tmp_path_factory.mktemp("xdist"))
    return d, _pytest(d, *GATED, *XDIST)


def test_a_world_size_list_without_1_passes_on_correct_code(cli_dir):
    """--world-sizes 2 alone: the W=1 run the cross-world-size check needs is added, not skipped."""
    tables, _ = load_tables(cli_dir / "reports" / "latest" / "verification_tables")
    assert "fsdp_impl-mlp-ws1-replicated-sgd" in set(tables["scenarios"]["scenario"])
    cross = tables["verdicts"].query("check == 'cross_ws_replicated'")
    assert list(cross["status"]) == ["pass"] and list(cross["scenario"]) == ["fsdp_impl-mlp-ws2-replicated-sgd"]


def test_default_output_goes_to_a_run_folder_that_reports_latest_points_at_not_the_committed_report(cli_dir):
    latest = cli_dir / "reports" / "latest"
    assert latest.is_symlink() and latest.resolve().parent == (cli_dir / "reports" / "runs").resolve()
    assert (cli_dir / REPORT).is_file() and (latest / "verification_plots").is_dir()
    assert not (cli_dir / "reports" / "verification.md").exists()
    for generated in ("reports/latest", "reports/runs/20260101-000000/verification.md"):
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", generated], cwd=ROOT).returncode
        assert ignored == 0, f"{generated} must be git-ignored"


def test_pytest_and_the_cli_write_the_same_tables_and_verdicts(cli_dir, xdist_run):
    tmp_path, proc = xdist_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / REPORT).is_file()
    assert _verdicts(tmp_path) == _verdicts(cli_dir)
    mine, _ = load_tables(tmp_path / "reports" / "latest" / "verification_tables")
    theirs, _ = load_tables(cli_dir / "reports" / "latest" / "verification_tables")
    assert set(mine) == set(theirs)
    cols = ["scenario", "step", "loss", "max_diff_ref", "max_diff_ws1"]
    pd.testing.assert_frame_equal(mine["steps"][cols], theirs["steps"][cols])
    # each records the command that made it
    assert load_tables(tmp_path / REPORT.parent / "verification_tables")[1][
        "command"
    ] == "python -m pytest " + shlex.join(_pytest_args(*GATED, *XDIST))
    assert load_tables(cli_dir / REPORT.parent / "verification_tables")[1][
        "command"
    ] == "python -m harness " + shlex.join(["run", *SLICE, *GATED])


def test_under_xdist_the_matrix_runs_once_and_one_report_is_written(xdist_run):
    tmp_path, proc = xdist_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the reference, W=1 and W=2: 3 scenarios, run by one worker, once
    assert proc.stderr.count("the matrix ran once, in xdist worker") == 1, proc.stderr
    assert proc.stderr.count("running 3 scenarios") == 1 and ": 3 scenarios" in proc.stderr, proc.stderr
    written = sorted(p.name for p in (tmp_path / "reports" / "latest").iterdir())
    assert written == ["verification.md", "verification_plots", "verification_tables"]
    assert len(_verdicts(tmp_path)) > 0


def test_under_xdist_the_report_records_the_pytest_command_line_not_the_workers(xdist_run):
    """The matrix runs in an xdist worker, whose argv is execnet's `-c`: the report must say the
    command that made the run, so that a reader can run it again."""
    tmp_path, proc = xdist_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, env = load_tables(tmp_path / "reports" / "latest" / "verification_tables")
    assert env["command"] == "python -m pytest " + shlex.join(_pytest_args(*GATED, *XDIST))
    rows = [line.split("|") for line in (tmp_path / REPORT).read_text().splitlines() if line.startswith("| command ")]
    assert [cells[2].strip() for cells in rows] == [env["command"]]  # the report's environment table says it too


def test_k_runs_only_the_selected_scenario_and_what_it_is_compared_with(tmp_path):
    # both data modes and optimizers: 10 scenarios in the matrix; the selected one needs the plain
    # reference and the same implementation at W=1, not the split-data runs; the AdamW one that -k
    # also selects is the slow tier's (the second optimizer's), skipped without --slow: not run either
    # and --no-plots through the plugin: the report says where each plot would be, its plots folder is empty
    proc = _pytest(
        tmp_path,
        "--data-modes",
        "replicated,split",
        "--optimizers",
        "sgd,adamw",
        "-k",
        "fsdp_impl-mlp-ws2-replicated",
        "--no-plots",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "running 3 scenarios" in proc.stderr, proc.stderr
    assert load_tables(tmp_path / REPORT.parent / "verification_tables")[1][
        "command"
    ] == "python -m pytest " + shlex.join(
        _pytest_args(
            "--data-modes",
            "replicated,split",
            "--optimizers",
            "sgd,adamw",
            "-k",
            "fsdp_impl-mlp-ws2-replicated",
            "--no-plots",
        )
    )  # without xdist: its own
    text = (tmp_path / REPORT).read_text()
    assert ": not drawn (--no-plots)._" in text and "](verification_plots/" not in text, text
    assert list((tmp_path / REPORT.parent / "verification_plots").iterdir()) == []
    assert {s for _, s, _ in _verdicts(tmp_path)} == {
        "reference-mlp-ws1-replicated-sgd",
        "fsdp_impl-mlp-ws1-replicated-sgd",
        "fsdp_impl-mlp-ws2-replicated-sgd",
    }


# an adapter with the required methods only: under no_sync and clip it supports nothing requested
BARE = "suites.harness.unit.example_adapter:adapter"
NOTHING_SUPPORTED = [
    "--impl",
    BARE,
    "--features",
    "no_sync,clip",
    "--world-sizes",
    "1,2",
    "--models",
    "mlp",
    "--optimizers",
    "sgd",
    "--data-modes",
    "replicated",
    "--steps",
    "2",
    "--no-plots",
]


def test_a_run_whose_implementation_ran_nothing_reads_not_run_and_exits_3(tmp_path):
    """Only the reference ran (its passes are no pass of the implementation): the report's overall
    line and the console's last line say NOT RUN, the first and last lines count the implementation's
    scenarios, and the exit status is EXIT_NOT_RUN."""
    from harness.session import EXIT_NOT_RUN

    proc = _run(["-m", "harness", "run", *NOTHING_SUPPORTED], tmp_path)
    assert proc.returncode == EXIT_NOT_RUN, proc.stderr
    lines = proc.stderr.strip().splitlines()
    # the reference and its noise probes: plain, no_sync, clip and clip nudged by 2 ulps (the probe of W = 2)
    assert lines[0].startswith("running 7 scenarios") and f"{BARE}: 0 to run, 4 unsupported" in lines[0], lines[0]
    assert lines[-1].startswith("NOT RUN: 0 passed") and f"{BARE}: 0 ran, 4 unsupported" in lines[-1], lines[-1]
    assert "**Overall: NOT RUN**" in (tmp_path / REPORT).read_text()


def test_under_pytest_not_run_fails_the_run(tmp_path):
    proc = _pytest(tmp_path, *NOTHING_SUPPORTED, "--no-report")  # the outcome, not the report (above)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert f"NOT RUN: {BARE} ran no scenario to its end" in proc.stderr, proc.stderr


def test_under_pytest_gate_strict_fails_a_gate_that_compared_nothing(xdist_run, tmp_path):
    """The committed baseline ran 10 steps: a 2-step run shares no comparable figure with it (and on
    a machine kind it has no file for, nothing at all). Reported without --gate-strict; failed with it."""
    _, proc = xdist_run
    assert proc.returncode == 0 and "the gate compared nothing with baseline 'default'" in proc.stderr, proc.stderr
    proc = _pytest(_with_baselines(tmp_path), *GATED, "--gate-strict", "--no-report")
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert "[FAIL] gate:coverage" in proc.stderr and "--gate-strict" in proc.stderr, proc.stderr
