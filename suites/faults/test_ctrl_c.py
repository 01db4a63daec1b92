"""Ctrl-C of `python -m harness run` at each moment of a run (the forkserver starting, a world
starting, mid-step, the report being written, the gate) and of a pytest-xdist run: exit
EXIT_INTERRUPTED, the one line "interrupted", no traceback, no process left behind, no report.

The subprocesses run in a session of their own, looked up by session id in /proc. Each test
interrupts at its moment for certain, whatever the load: it waits until /proc or the file system
shows that moment, and where the moment is short it freezes the process that would leave it
(SIGSTOP), sends Ctrl-C to the whole process group as a terminal does, then lets it go on (SIGCONT); or it
gives the SIGINT to a thread of the parent other than its main one, as the kernel may.
The moments that nothing outside the process shows, or too briefly (a world worker before its
entry point, the gate), are held by suites/faults/paused_cli.py.

All of them are the CI tier's (`--ci`): the forkserver's start, a world's start, the report and the gate
here, mid-step in test_launch_context.py (as a background job; run here as well with `--slow`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.execute.forked_server import is_forkserver
from harness.session import EXIT_INTERRUPTED
from suites.faults.paused_cli import THREADED
from suites.faults.processes import alive, in_session, kill_session, start, wait_session_empty
from suites.faults.scenarios import FA

# the CI tier (--ci; .ci/run runs it): each test starts and interrupts a CLI or pytest run
pytestmark = pytest.mark.ci

# two scenarios (the reference's and fsdp_impl's) in one world of 1 rank
SMALL = [
    "--world-sizes",
    "1",
    "--models",
    "mlp",
    "--impl",
    "fsdp_impl",
    "--data-modes",
    "replicated",
    "--optimizers",
    "adamw",
    "--steps",
    "2",
]
CLI = [sys.executable, "-m", "harness", "run"]


def _poll(proc: subprocess.Popen, find, within_s: float = 120, every_s: float = 0.01):
    """``find()``'s first true value, polled while ``proc`` runs."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = find()
        if found:
            return found
        time.sleep(every_s)
    assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.communicate()}"
    raise AssertionError(f"not seen within {within_s} s")


def _ctrl_c(proc: subprocess.Popen, frozen: int | None = None, until=None) -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C; then, once ``until()`` holds, let
    ``frozen`` go on."""
    os.killpg(proc.pid, signal.SIGINT)
    if until is not None:
        _poll(proc, until)
    if frozen is not None:
        with contextlib.suppress(ProcessLookupError):  # the run may have killed it already
            os.kill(frozen, signal.SIGCONT)


def _assert_interrupted(proc: subprocess.Popen, report: Path, timeout: float = 60) -> None:
    """``report`` is in a folder the run had to make: no report, no half of one, no staging or backup
    folder, and no empty folder is left."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == EXIT_INTERRUPTED, (proc.returncode, err)
    assert "Traceback" not in err + out, err
    tail = [line for line in err.splitlines() if not line.startswith(("running ", "["))]
    assert tail == ["interrupted"], err
    assert wait_session_empty(proc.pid, 10) == []
    assert not report.parent.exists(), list(report.parent.iterdir())


def test_ctrl_c_while_the_forkserver_starts(tmp_path):
    """The forkserver is still importing torch (it ignores SIGINT only once it has): frozen there,
    it gets the Ctrl-C in its imports (before the fix: a traceback ending in KeyboardInterrupt)."""
    report = tmp_path / "out" / "r.md"
    proc = start([*CLI, *SMALL, "--report", str(report)])
    try:
        server = _poll(proc, lambda: next(iter(_forkservers(proc, _importing)), None))
        os.kill(server, signal.SIGSTOP)
        assert _importing(server), "the forkserver finished starting before it could be frozen"
        _ctrl_c(proc, frozen=server)
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


def test_ctrl_c_while_a_world_starts(tmp_path):
    """The world of 1's worker is forked but has not reached its entry point (held there by
    paused_cli, with the signal handling of multiprocessing's bootstrap) and the parent waits for it
    to be ready. The parent is frozen until the worker has taken the SIGINT (before the fix: a
    traceback ending in KeyboardInterrupt, then its end) or holds it blocked: otherwise the parent
    would often kill it first."""
    proc, report = _start_paused(tmp_path, "harness.execute.worker:main", *SMALL)
    try:
        [worker] = _forkservers(proc, lambda pid: not _ignores_sigint(pid))  # the forkserver ignores it
        os.kill(proc.pid, signal.SIGSTOP)
        _ctrl_c(proc, frozen=proc.pid, until=lambda: not alive(worker) or _holds_sigint(worker))
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


def test_ctrl_c_taken_by_another_thread_while_a_world_starts(tmp_path):
    """A parent with a thread of its own before its first world (a program's, pytest-xdist's; the forkserver is
    then executed, not forked) gets the Ctrl-C on that thread while the world of 1's worker is held before its
    entry point and the parent waits for it: Python runs the handler in the main thread, which must not stay in
    its wait for the worker (before the fix: until the scenario's timeout)."""
    proc, report = _start_paused(tmp_path, "harness.execute.worker:main", *SMALL, threaded=True)
    try:
        assert [p for p in _forkservers(proc, _ignores_sigint) if _executed(p)], "the forkserver was not executed"
        [other] = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.tgkill(proc.pid, other, signal.SIGINT) == 0, os.strerror(ctypes.get_errno())
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


@pytest.mark.slow
def test_ctrl_c_of_the_cli_exits_non_zero_with_one_line_and_no_orphans(tmp_path):
    """Mid-step: rank 1 hangs with a timeout far away, so the world of 2 is certainly mid-run.

    The CI tier runs it once, from test_launch_context.py (launched as a background job with SIGINT
    and SIGHUP ignored and stdin closed): run here as well, it is the same run from a friendlier parent."""
    report = tmp_path / "out" / "r.md"
    proc = start(
        [
            *CLI,
            "--world-sizes",
            "1,2",
            "--models",
            "mlp",
            "--impl",
            f"{FA}:hang_rank1",
            "--data-modes",
            "replicated",
            "--optimizers",
            "adamw",
            "--steps",
            "3",
            "--scenario-timeout",
            "600",
            "--report",
            str(report),
        ]
    )
    try:
        # the forkserver and the 2 workers of the world of 2 (the world of 1 had 1)
        _poll(proc, lambda: len(_forkservers(proc, _ignores_sigint)) >= 3, every_s=0.2)
        _ctrl_c(proc)
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


def test_ctrl_c_while_the_report_is_written(tmp_path):
    """Frozen while its outputs are staged beside the report (.fsdp-harness-out-*) and before the
    tables, the last of them, are in place: nothing of the report may be left."""
    report = tmp_path / "out" / "r.md"
    proc = start([*CLI, *SMALL, "--report", str(report)])
    try:
        _poll(proc, lambda: list(report.parent.glob(".fsdp-harness-out-*")))
        os.kill(proc.pid, signal.SIGSTOP)
        assert list(report.parent.glob(".fsdp-harness-out-*")) and not (report.parent / "r_tables").exists(), (
            "the report was written before the run could be frozen"
        )
        _ctrl_c(proc, frozen=proc.pid)
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


def test_ctrl_c_during_the_gate(tmp_path):
    proc, report = _start_paused(tmp_path, "harness.gate.compare:compare", *SMALL, "--baseline", "default")
    try:
        _ctrl_c(proc)
        _assert_interrupted(proc, report)
    finally:
        kill_session(proc)


def _start_paused(tmp_path: Path, target: str, *args: str, threaded: bool = False) -> tuple[subprocess.Popen, Path]:
    """The CLI run paused at ``target`` (suites/faults/paused_cli.py), once it is there; its report. ``threaded``:
    the CLI's process has a second thread from before its first world."""
    report, marker = tmp_path / "out" / "r.md", tmp_path / "paused"
    first = [THREADED] if threaded else []
    proc = start(
        [sys.executable, "-m", "suites.faults.paused_cli", *first, target, str(marker), "run", *args]
        + ["--report", str(report)]
    )
    try:
        _poll(proc, marker.exists, every_s=0.1)
    except BaseException:
        kill_session(proc)
        raise
    return proc, report


def _forkservers(proc: subprocess.Popen, keep) -> list[int]:
    """The processes of ``proc``'s session that are the forkserver, executed or forked (and every world
    worker forked from it: they keep its mark), and pass ``keep``."""
    return [p for p in in_session(proc.pid) if is_forkserver(p) and keep(p)]


def _executed(pid: int) -> bool:
    """A forkserver started as multiprocessing starts it (a new interpreter), not forked from its parent."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.forkserver import main" in f.read()
    except OSError:
        return False


def _signals(pid: int, field: str) -> int:
    """A signal mask of /proc/<pid>/status (SigIgn, SigCgt, SigBlk, ShdPnd: pending); 0 if the
    process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith(f"{field}:")), 16)
    except (OSError, StopIteration):
        return 0


def _has(mask: int, sig: signal.Signals) -> bool:
    return bool(mask >> (sig - 1) & 1)


def _ignores_sigint(pid: int) -> bool:
    """Past its start: the forkserver ignores SIGINT once its imports are done, a worker from its
    entry point on (a worker still in multiprocessing's bootstrap is a world starting)."""
    return _has(_signals(pid, "SigIgn"), signal.SIGINT)


def _holds_sigint(pid: int) -> bool:
    """SIGINT is blocked and pending: the process will not take it."""
    return _has(_signals(pid, "SigBlk"), signal.SIGINT) and _has(_signals(pid, "ShdPnd"), signal.SIGINT)


def _importing(pid: int) -> bool:
    """The forkserver's interpreter is up (it catches SIGINT) and its imports are not done (it
    catches SIGCHLD from then on, and ignores SIGINT)."""
    caught = _signals(pid, "SigCgt")
    return _has(caught, signal.SIGINT) and not _has(caught, signal.SIGCHLD)


def test_ctrl_c_of_a_pytest_xdist_run_leaves_no_orphans(tmp_path):
    proc = start(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-q",
            "-p",
            "no:cacheprovider",
            "suites/harness/end_to_end/test_equivalence.py",
            "--world-sizes",
            "1,2",
            "--models",
            "mlp",
            "--impl",
            f"{FA}:hang_rank1",
            "--data-modes",
            "replicated",
            "--optimizers",
            "adamw",
            "--steps",
            "3",
            "--scenario-timeout",
            "600",
            "--report",
            str(tmp_path / "r.md"),
        ]
    )
    try:
        # the matrix runs once, in one xdist worker: its forkserver and the hanging world of 2
        _poll(proc, lambda: len(_forkservers(proc, _ignores_sigint)) >= 3, within_s=180, every_s=0.2)
        _ctrl_c(proc)
        proc.communicate(timeout=90)
        assert proc.returncode not in (0, None)
        assert wait_session_empty(proc.pid, 15) == []
    finally:
        kill_session(proc)
