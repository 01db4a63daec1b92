"""Ctrl-C of `python -m harness run` and of a pytest-xdist run, mid-matrix: a non-zero exit, one
line, and no process left behind (the subprocesses run in a session of their own, looked up by
session id in /proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from suites.faults.processes import in_session, kill_session, start, wait_session_empty
from suites.faults.scenarios import FA


def _interrupt_when(proc: subprocess.Popen, ready, within_s: float = 120) -> int:
    """Wait until ``ready(forkserver processes)``, then Ctrl-C the session as a terminal would
    (SIGINT to the whole foreground process group); returns the count just before."""
    deadline = time.monotonic() + within_s
    count = 0
    while time.monotonic() < deadline and proc.poll() is None:
        count = _forkserver_processes(in_session(proc.pid))
        if ready(count):
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.communicate()}"
    os.killpg(proc.pid, signal.SIGINT)
    return count


def test_ctrl_c_of_the_cli_exits_non_zero_with_one_line_and_no_orphans(tmp_path):
    # rank 1 hangs with a timeout far away: the world of 2 is certainly mid-run at the Ctrl-C
    proc = start([sys.executable, "-m", "harness", "run", "--world-sizes", "1,2", "--models", "mlp",
                  "--impl", f"{FA}:hang_rank1", "--data-modes", "replicated", "--optimizers", "adamw",
                  "--steps", "3", "--scenario-timeout", "600", "--report", str(tmp_path / "r.md")])
    try:
        # the forkserver and the 2 workers of the world of 2 (the world of 1 had 1)
        assert _interrupt_when(proc, lambda n: n >= 3) >= 3
        out, err = proc.communicate(timeout=60)
        assert proc.returncode not in (0, None)
        assert "Traceback" not in err + out
        tail = [line for line in err.splitlines() if not line.startswith(("running ", "["))]
        assert tail == ["interrupted"], err
        assert wait_session_empty(proc.pid, 10) == []
        assert not (tmp_path / "r.md").exists()  # no half-written report
    finally:
        kill_session(proc)


def _forkserver_processes(pids: list[int]) -> int:
    """How many of ``pids`` run multiprocessing's forkserver code and are past their start: each
    forkserver and every world worker forked from it (they keep its command line) that ignores
    SIGINT, as the forkserver does and a worker does from its entry point on. A worker still in
    multiprocessing's bootstrap is a world starting, not a run mid-way."""
    return sum(1 for p in pids if b"multiprocessing.forkserver" in _cmdline(p) and _ignores_sigint(p))


def _ignores_sigint(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_ctrl_c_of_a_pytest_xdist_run_leaves_no_orphans(tmp_path):
    proc = start([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                  "suites/test_equivalence.py", "--world-sizes", "1,2", "--models", "mlp",
                  "--impl", f"{FA}:hang_rank1", "--data-modes", "replicated", "--optimizers", "adamw",
                  "--steps", "3", "--scenario-timeout", "600", "--report", str(tmp_path / "r.md")])
    try:
        # the matrix runs once, in one xdist worker: its forkserver and the hanging world of 2
        assert _interrupt_when(proc, lambda n: n >= 3, within_s=180) >= 3
        proc.communicate(timeout=90)
        assert proc.returncode not in (0, None)
        assert wait_session_empty(proc.pid, 15) == []
    finally:
        kill_session(proc)
