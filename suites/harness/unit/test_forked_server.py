"""The forkserver forked from a single-threaded parent (harness/execute/forked_server.py) is an executed one's
equal: it holds none of its parent's descriptors, none of its signal handlers, and ends with its parent; a
parent with a second thread gets multiprocessing's executed server instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from suites.harness.unit.test_world import wait_all_dead

ROOT = Path(__file__).resolve().parents[3]

PARENT = textwrap.dedent("""
    import json, os, signal, sys, threading
    from harness.execute.forked_server import is_forkserver
    from harness.execute.world import World

    signal.signal(signal.SIGTERM, lambda *_: None)  # a handler the program installed
    held_r, held_w = os.pipe()  # a descriptor the parent holds, as it holds each world's lifeline
    if sys.argv[1] == "thread":
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    with World(2, timeout_s=120) as world:
        ranks = world.call("suites.harness.unit.world_tasks:whoami", None)
        from multiprocessing import forkserver
        server = forkserver._forkserver._forkserver_pid
        def fds(pid):
            return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        def caught(pid):
            with open(f"/proc/{pid}/status") as f:
                return int(next(l.split()[1] for l in f if l.startswith("SigCgt:")), 16)
        pipes = {f"pipe:[{os.fstat(fd).st_ino}]" for fd in (held_r, held_w)}
        print(json.dumps({
            "server": server, "comm": open(f"/proc/{server}/comm").read().strip(),
            "cmdline": open(f"/proc/{server}/cmdline", "rb").read().decode(errors="replace"),
            "marked": [is_forkserver(p) for p in (server, *world.pids)], "parent_marked": is_forkserver(os.getpid()),
            "holds_parents_pipe": [bool(pipes & set(fds(p))) for p in (server, *world.pids)],
            "server_catches_sigterm": bool(caught(server) >> (signal.SIGTERM - 1) & 1),
            "ranks": ranks}))
""")


def _run_parent(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PARENT, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )  # a server that kept its alive pipe would never end: no output
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.ci  # a parent process started with its own world
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked server is Linux's (/proc)")
def test_a_single_threaded_parent_forks_a_server_that_holds_nothing_of_it_and_ends_with_it():
    got = _run_parent("single")
    assert got["comm"] == "fsdp-forkserver" and "multiprocessing.forkserver" not in got["cmdline"], got
    assert got["marked"] == [True, True, True] and not got["parent_marked"]
    assert got["holds_parents_pipe"] == [False, False, False]  # a lifeline held there would keep workers alive
    assert not got["server_catches_sigterm"]  # the parent's handler is not the server's
    assert [(r["rank"], r["threads"], r["deterministic"]) for r in got["ranks"]] == [(0, 1, True), (1, 1, True)]
    assert wait_all_dead([got["server"]], 10) == []


@pytest.mark.ci  # a parent process started with its own world
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked server is Linux's (/proc)")
def test_a_parent_with_a_second_thread_gets_the_executed_server():
    got = _run_parent("thread")
    assert "multiprocessing.forkserver" in got["cmdline"] and got["comm"] != "fsdp-forkserver", got
    assert got["marked"] == [True, True, True] and got["holds_parents_pipe"] == [False, False, False]
    assert wait_all_dead([got["server"]], 10) == []


@pytest.mark.ci  # two fresh interpreters
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads counted in /proc")
def test_the_cli_process_stays_single_threaded_through_its_imports_unless_the_user_asked_for_threads():
    """numpy's OpenBLAS starts a thread pool at import where OMP_NUM_THREADS is unset (2 threads on 2
    cores), which would leave every CLI run the executed server; `python -m harness` asks for one thread
    first, and keeps a value the user set."""
    code = (
        "import harness.__main__, os, harness.cli, numpy, torch\n"
        "from harness.execute.forked_server import single_threaded\n"
        "print(single_threaded(), os.environ['OMP_NUM_THREADS'])"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    }
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "1"], out.stdout + out.stderr
    env["OMP_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[1] == "2", out.stdout + out.stderr
