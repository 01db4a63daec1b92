"""`python -m harness run` in an unfriendly process environment: a shell with stale torchrun
variables, and SIGTERM / SIGHUP from a job manager or a closed terminal."""

from __future__ import annotations

import os
import subprocess
import sys

from suites.faults.test_faults import ENV, kill_session, start, wait_session_empty

TINY = ["--world-sizes", "1", "--impl", "fsdp_impl", "--models", "mlp", "--data-modes", "replicated",
        "--optimizers", "sgd", "--steps", "2"]


def test_stale_torchrun_variables_in_the_shell_do_not_make_a_plain_run_wait_for_peers(tmp_path):
    # what a shell keeps after e.g. `export RANK=0 WORLD_SIZE=2 ...` for another job; no torchrun here
    stale = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", *TINY, "--report", str(tmp_path / "r.md")],
                            env={**ENV, **stale}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)  # ~5 s on 2 cores; a torchrun rank would wait 5 min
        assert proc.returncode == 0, out + err
        assert "running 2 scenarios in worlds of 1 ranks" in err
        assert (tmp_path / "r.md").is_file()
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)
