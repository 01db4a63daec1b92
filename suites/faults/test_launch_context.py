"""The signal tests pass whatever the launching shell left them: run from a parent that ignores
SIGINT and SIGHUP (a script's background job, `nohup`), with stdin closed and no controlling terminal
(a CI runner), they still Ctrl-C and hang up the processes they start (each sets the dispositions it
relies on, see suites/faults/processes.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from suites.faults.processes import ENV, ROOT

# the CI tier (--ci; .ci/run runs it): a nested pytest run of the signal tests
pytestmark = pytest.mark.ci

# what `nohup cmd <&- &` in a script leaves cmd: SIGINT and SIGHUP ignored, no stdin
BACKGROUND_JOB = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
    "os.close(0)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])\n"
)

# the signal tests the CI tier runs here only (the slow tier's when run directly; --slow in the inner
# run): Ctrl-C of the CLI's process group, and SIGHUP of the CLI alone. Both rely on the default action
# of a signal that a background job's parent ignores.
SIGNAL_TESTS = [
    "suites/faults/test_ctrl_c.py::test_ctrl_c_of_the_cli_exits_non_zero_with_one_line_and_no_orphans",
    "suites/faults/test_signals_and_env.py::test_sigterm_or_sighup_of_the_cli_unwinds_like_ctrl_c[SIGHUP]",
]


def test_the_signal_tests_pass_when_started_as_a_background_job_with_signals_ignored(tmp_path):
    cmd = [
        sys.executable,
        "-c",
        BACKGROUND_JOB,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--basetemp",
        str(tmp_path / "inner"),
        "--slow",
        *SIGNAL_TESTS,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert f"{len(SIGNAL_TESTS)} passed" in proc.stdout, proc.stdout[-4000:]
