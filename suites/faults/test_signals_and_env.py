"""`python -m harness run` in an unfriendly process environment: a shell with stale torchrun
variables, and SIGTERM / SIGHUP from a job manager or a closed terminal."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

from suites.faults.test_faults import ENV, FA, ROOT, kill_session, wait_session_empty


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


SMALL = ["--models", "mlp", "--data-modes", "replicated", "--optimizers", "sgd", "--steps", "2"]


def test_stale_torchrun_variables_in_the_shell_do_not_make_a_plain_run_wait_for_peers(tmp_path):
    # what a shell keeps after e.g. `export RANK=0 WORLD_SIZE=2 ...` for another job; no torchrun here
    stale = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = start([sys.executable, "-m", "harness", "run", "--world-sizes", "1", "--impl", "fsdp_impl", *SMALL,
                  "--report", str(tmp_path / "r.md")],
                 env={**ENV, **stale})
    try:
        out, err = proc.communicate(timeout=90)  # ~5 s on 2 cores; a torchrun rank would wait 5 min
        assert proc.returncode == 0, out + err
        assert "running 2 scenarios in worlds of 1 ranks" in err
        assert (tmp_path / "r.md").is_file()
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_of_the_cli_unwinds_like_ctrl_c(tmp_path, sig):
    """`kill PID` (or a closed terminal) mid-run: the run ends at once, its worlds' workers die and
    its temp dirs (snapshots, FileStores, the forkserver's socket dir) are removed."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    # world of 1: progress lines; then rank 1 of the world of 2 hangs, so the run is certainly mid-way
    cmd = [sys.executable, "-m", "harness", "run", "--world-sizes", "1,2", "--impl", f"{FA}:hang_rank1", *SMALL,
           "--scenario-timeout", "600", "--report", str(tmp_path / "r.md")]
    # torch's own per-user cache dir (created in TMPDIR by default, and kept by every run) goes elsewhere
    proc = start(cmd, env={**ENV, "TMPDIR": str(tmpdir), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    try:
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
        reader.start()
        while not lines.get(timeout=120).startswith("["):  # a progress line: "[  1/4] <scenario> <secs>s"
            pass
        assert any(tmpdir.iterdir())  # the run's temp dirs exist before the signal
        os.kill(proc.pid, sig)  # to the CLI process alone, as `kill PID` does
        assert proc.wait(timeout=30) not in (0, None)
        assert wait_session_empty(proc.pid, 10) == []
        reader.join(10)
        rest = [lines.get_nowait().rstrip() for _ in range(lines.qsize())]
        assert rest[-1:] == ["interrupted"] and not any("Traceback" in line for line in rest), rest
        assert sorted(p.name for p in tmpdir.iterdir()) == []
        assert not (tmp_path / "r.md").exists()
    finally:
        kill_session(proc)


def test_a_termination_handler_the_program_installed_is_kept():
    code = ("import signal\n"
            "from harness.world import WorldPool\n"
            "mine = lambda *_: None\n"
            "signal.signal(signal.SIGTERM, mine)\n"
            "WorldPool()\n"
            "print(signal.getsignal(signal.SIGTERM) is mine, signal.getsignal(signal.SIGHUP) is signal.SIG_DFL)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr
