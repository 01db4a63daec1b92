"""`python -m harness run` in an unfriendly process environment: a shell with stale torchrun
variables, and SIGTERM / SIGHUP from a job manager or a closed terminal."""

from __future__ import annotations

import itertools
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from suites.faults.processes import ENV, ROOT, default_signals, kill_session, start, wait_session_empty
from suites.faults.scenarios import FA

# the CI tier (--ci; .ci/run runs it): each test starts a CLI run or a torchrun store of its own
pytestmark = pytest.mark.ci


SMALL = [
    "--models",
    "mlp",
    "--data-modes",
    "replicated",
    "--optimizers",
    "sgd",
    "--steps",
    "2",
    "--no-plots",
]  # what these runs hold is no plot's business: each costs 0.1 to 0.2 CPU s


def test_a_plain_run_goes_on_in_a_shell_with_stale_torchrun_variables_and_a_deep_temp_dir(tmp_path):
    """Two things a user's shell may hold, in one run (each a CLI run of its own before; a failure names which):
    torchrun's variables kept after e.g. `export RANK=0 WORLD_SIZE=2 ...` for another job, with no torchrun
    here, must not make the run wait for peers (a torchrun rank would wait 5 minutes); and the forkserver's
    socket lives under TMPDIR, where Linux caps a socket path at 107 bytes: a deep TMPDIR (pytest's own
    tmp_path under a long test name is one) must not break the run."""
    stale = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    tmpdir = tmp_path / ("t" * 80)
    tmpdir.mkdir()
    assert len(str(tmpdir)) + len("/pymp-XXXXXXXX/listener-XXXXXXXX") > 107
    proc = start(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1,2",
            "--impl",
            "fsdp_impl",
            *SMALL,
            "--report",
            str(tmp_path / "r.md"),
        ],
        env={**ENV, **stale, "TMPDIR": str(tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
    )
    try:
        out, err = proc.communicate(timeout=120)  # ~6 s on 2 cores
        assert proc.returncode == 0, out + err
        assert "Traceback" not in err, err
        assert "in worlds of 1,2 ranks" in err, f"the stale torchrun variables made it a torchrun job: {err}"
        assert (tmp_path / "r.md").is_file()
        assert sorted(p.name for p in tmpdir.iterdir()) == [], "the deep TMPDIR kept files behind"
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)


def first_progress_line(proc: subprocess.Popen, lines: queue.Queue[str | None], within_s: float) -> str:
    """Read the CLI's stderr until its first progress line ("[  1/4] <scenario> <secs>s"); fail with
    what it printed if it exits or stays silent first."""
    seen = []
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            pytest.fail(f"the run ended (exit {proc.wait()}) before its first progress line:\n" + "".join(seen))
        if line.startswith("["):
            return line
        seen.append(line)
    pytest.fail(f"no progress line within {within_s:.0f} s; it printed:\n" + "".join(seen))


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)], ids=["SIGTERM", "SIGHUP"]
)
def test_sigterm_or_sighup_of_the_cli_unwinds_like_ctrl_c(tmp_path, sig):
    """`kill PID` (or a closed terminal) mid-run: the run ends at once, its worlds' workers die and
    its temp dirs (snapshots, FileStores, the forkserver's socket dir) are removed. The CI tier runs
    the SIGHUP case once, from test_launch_context.py (a parent that ignores SIGINT and SIGHUP)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # world of 1: progress lines; then rank 1 of the world of 2 hangs, so the run is certainly mid-way
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "--world-sizes",
        "1,2",
        "--impl",
        f"{FA}:hang_rank1",
        *SMALL,
        "--scenario-timeout",
        "600",
        "--report",
        str(tmp_path / "r.md"),
    ]
    # torch's own per-user cache dir (created in TMPDIR by default, and kept by every run) goes elsewhere
    proc = start(cmd, env={**ENV, "TMPDIR": str(tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    try:
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(
            target=lambda: [lines.put(line) for line in itertools.chain(proc.stderr, [None])], daemon=True
        )
        reader.start()
        first_progress_line(proc, lines, within_s=120)
        assert any(tmpdir.iterdir())  # the run's temp dirs exist before the signal
        os.kill(proc.pid, sig)  # to the CLI process alone, as `kill PID` does
        assert proc.wait(timeout=30) not in (0, None)
        assert wait_session_empty(proc.pid, 10) == []
        reader.join(10)
        rest = [line.rstrip() for line in (lines.get_nowait() for _ in range(lines.qsize())) if line is not None]
        assert rest[-1:] == ["interrupted"] and not any("Traceback" in line for line in rest), rest
        assert sorted(p.name for p in tmpdir.iterdir()) == []
        assert not (tmp_path / "r.md").exists()
    finally:
        kill_session(proc)


def test_a_termination_handler_the_program_installed_is_kept():
    code = (
        "import signal\n"
        "from harness.execute.world import WorldPool\n"
        "mine = lambda *_: None\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "WorldPool()\n"
        "print(signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)\n"
    )
    out = subprocess.run(
        default_signals([sys.executable, "-c", code]), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr


def test_a_temp_dir_that_fills_up_during_the_run_is_one_line_not_scenario_failures(tmp_path):
    """Every torch.save of the ranks fails as on a full disk: the run ends with one line naming the temp
    dir (exit 1), not a failing scenario with a traceback each; no worker survives."""
    proc = start(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1,2",
            "--impl",
            f"{FA}:disk_full",
            *SMALL,
            "--no-report",
        ],
        env=ENV,
    )
    try:
        out, err = proc.communicate(timeout=120)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 1 and "Traceback" not in err, out + err
        assert len(errors) == 1 and "cannot take the run's files: No space left on device" in errors[0], err
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LEFT_OVER = {
    "TORCHELASTIC_RUN_ID": "old-job",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.mark.parametrize("partial", [False, True], ids=["all_of_torchruns_variables", "without_the_agents_own"])
def test_torchrun_variables_left_over_from_another_job_are_explained_within_seconds(partial):
    """No agent, no peers: the run must not wait the group timeout (minutes) to join them."""
    env = {**ENV, **LEFT_OVER, "MASTER_PORT": str(_unused_port())}
    if partial:
        del env["TORCHELASTIC_USE_AGENT_STORE"]
    t0 = time.monotonic()
    proc = start(
        [sys.executable, "-m", "harness", "run", "--world-sizes", "1,2", "--impl", "fsdp_impl", *SMALL, "--no-report"],
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=90)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and "Traceback" not in err, out + err
        assert len(errors) == 1 and "TORCHELASTIC_RUN_ID=old-job and RANK=1 are set" in errors[0], err
        assert "left over from another job?" in errors[0]
        assert time.monotonic() - t0 < 60
    finally:
        kill_session(proc)


def test_ctrl_c_ends_the_wait_for_a_torchrun_store_that_is_not_there():
    env = {**ENV, **LEFT_OVER, "MASTER_PORT": str(_unused_port())}
    proc = start(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1,2",
            "--impl",
            "fsdp_impl",
            *SMALL,
            "--no-report",
            "--scenario-timeout",
            "600",
        ],
        env=env,
    )
    try:
        import select

        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, "no line within 60 s: it waits in silence"
        said = proc.stderr.readline()  # the first line it prints is that it waits, and for what
        assert said.startswith("waiting up to ") and "torchrun's store" in said and "Ctrl-C stops" in said, said
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=10) == 130
        assert proc.stderr.read().strip().splitlines() == ["interrupted"]
    finally:
        kill_session(proc)


def test_a_hangup_or_ctrl_c_ignored_at_start_stays_ignored():
    """Under `nohup` (SIGHUP) or as a script's background job (SIGINT too) the run ignores what its
    user's shell asked it to ignore: the harness installs its handlers only over default actions."""
    code = (
        "import signal\n"
        "from harness.execute.world import WorldPool\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "WorldPool()\n"
        "print(*(signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGHUP, signal.SIGINT)))\n"
    )
    out = subprocess.run(
        default_signals([sys.executable, "-c", code]), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
