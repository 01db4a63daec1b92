"""Ctrl-C in the first seconds of `python -m harness run`, its imports included: at every one of many moments
it ends with EXIT_INTERRUPTED and the one line "interrupted", no traceback, no process left, no report
(harness/core/interrupt.py: a Ctrl-C in an import is held until the import is done, one that something swallowed
still ends the run).

The moments are counted from the first import the harness makes once it has taken Ctrl-C over (the run is
started with `-X importtime`, whose lines say when each import ends; they are left out of what is held to one
line). Before that the interpreter starts, site's imports among them: Python's own, not the harness's.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from harness.session import EXIT_INTERRUPTED
from suites.faults.processes import kill_session, start, wait_session_empty

# the CI tier (--ci; .ci/run runs it): each moment starts and interrupts a CLI run
pytestmark = pytest.mark.ci

SMALL = [
    "--world-sizes",
    "1,2",
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
# seconds after the anchor: dense where the imports are, then through world starts and the first scenarios
MOMENTS = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.65, 0.8, 1.0, 1.3, 1.6)
MOMENTS += (2.0, 2.5, 3.0)
ANCHOR = "harness.core.interrupt"  # the import line after which the harness holds Ctrl-C


class _Lines:
    """A pipe read line by line in a thread; `wait_after(text)` returns once a line after the one naming `text`
    has come (or the pipe ended)."""

    def __init__(self, pipe) -> None:
        self.lines: list[str] = []
        self._seen = threading.Event()
        self._anchor_at: int | None = None
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append(line.rstrip("\n"))
            if self._anchor_at is None and line.startswith("import time:") and line.split("|")[-1].strip() == ANCHOR:
                self._anchor_at = len(self.lines)
            elif self._anchor_at is not None:
                self._seen.set()
        self._seen.set()

    def wait_after_anchor(self, within_s: float = 60) -> bool:
        return self._seen.wait(within_s) and self._anchor_at is not None

    def text(self) -> str:
        self._thread.join(60)
        return "\n".join(self.lines)


@pytest.mark.parametrize("moment", MOMENTS, ids=[f"{m:.3f}s" for m in MOMENTS])
def test_ctrl_c_at_any_moment_of_the_first_seconds(tmp_path, moment):
    report = tmp_path / "out" / "r.md"
    proc = start([sys.executable, "-X", "importtime", "-m", "harness", "run", *SMALL, "--report", str(report)])
    try:
        err = _Lines(proc.stderr)
        assert err.wait_after_anchor(), err.text()
        time.sleep(moment)
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        proc.wait(timeout=120)
        out, text = proc.stdout.read(), err.text()
        said = [
            line
            for line in text.splitlines()
            if not line.startswith(("import time:", "running ", "[")) and line.strip()
        ]
        assert proc.returncode == EXIT_INTERRUPTED and said == ["interrupted"], (proc.returncode, text[-3000:])
        assert "Traceback" not in text + out
        assert wait_session_empty(proc.pid, 10) == []
        assert not report.parent.exists()
    finally:
        kill_session(proc)
