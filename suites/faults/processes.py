"""Processes the fault tests start and look for afterwards.

``start`` runs a command (the CLI, pytest, torchrun) from the repository root in a session of its
own, with SIGINT, SIGHUP and SIGTERM at their default actions (``default_signals``): the tests that
signal it rely on those, and must not inherit what the launching shell set (a script's background
job and ``nohup`` start pytest with SIGINT and SIGHUP ignored, and an ignored signal stays ignored
in every child). ``in_session`` / ``wait_session_empty`` find what is left of that session by its id in /proc,
and ``kill_session`` cleans up after a failed test. ``alive`` / ``wait_all_dead`` watch single pids.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def stat_of(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running: a zombie counts as dead (its parent may just not have reaped it yet)."""
    st = stat_of(pid)
    return st is not None and st[0] != "Z"


def wait_all_dead(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def in_session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a subprocess started with start_new_session=True and
    everything it started that did not leave the session: forkservers, workers, torchrun ranks)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = stat_of(int(name))
            if st is not None and st[0] != "Z" and int(st[3]) == sid:
                out.append(int(name))
    return out


def wait_session_empty(sid: int, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return in_session(sid)


# Run as `python -c RESET_SIGNALS cmd...`: reset the dispositions, then become cmd (same pid). A
# wrapper rather than a preexec_fn, which is not safe while the test process has threads.
RESET_SIGNALS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)


def default_signals(cmd: list[str]) -> list[str]:
    """``cmd`` started with SIGINT, SIGHUP and SIGTERM (and SIGPIPE, as subprocess restores it) at
    their default actions, whatever this process inherited."""
    return [sys.executable, "-c", RESET_SIGNALS, *cmd]


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        default_signals(cmd),
        cwd=ROOT,
        env=ENV if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_session(proc: subprocess.Popen) -> None:
    """Last resort in a finally: whatever the test left of the session it started."""
    if in_session(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
