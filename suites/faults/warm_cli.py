"""Many short `python -m MODULE ARGS...` runs from one interpreter that has imported torch once.

The bad-input probes are dozens of runs of the CLI and of pytest that stop with a usage error;
about half of them get past argparse and import torch first (2 of their 2.5 CPU seconds). ``run``
starts one server process (``serve``) that imports torch, then forks one child per run; the child
becomes what `python -m MODULE ARGS...` is at its start and runs MODULE exactly as the interpreter
does (``runpy._run_module_as_main``, the function `python -m` calls), with the run's own stdout,
stderr, PYTHONPATH, sys.path and argv, and ends through the interpreter's normal exit (atexit
handlers, exit status, an uncaught exception's traceback). What a child cannot show is what a
fresh process would print while importing torch: the server captures that import's output and
refuses to serve if there is any, and it refuses if the import left a thread running (a fork
would not have it). Environment variables that modules read at import (TMPDIR, torchrun's) are
the server's own: a run that sets any is no run for it (``run`` takes none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PRELOAD = ("torch",)


def run(jobs: list[dict], env: dict, cwd: Path, workers: int, timeout_s: float) -> list[int | None]:
    """Each job: ``module``, ``args``, ``pythonpath`` (the run's PYTHONPATH), ``stdout`` and
    ``stderr`` (files the run writes to). Its exit status (as subprocess gives it; None if it
    ran past ``timeout_s`` and was killed), in ``jobs``' order."""
    spec = json.dumps({"jobs": jobs, "workers": workers, "timeout_s": timeout_s})
    proc = subprocess.run(
        [sys.executable, "-c", "from suites.faults.warm_cli import serve; serve()"],
        input=spec,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s * (len(jobs) + 1),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the warm CLI server failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    done = dict(json.loads(line) for line in proc.stdout.splitlines())
    return [done[str(i)] for i in range(len(jobs))]


def serve() -> None:
    """Read the jobs (JSON on stdin), import PRELOAD, fork each job (at most ``workers`` at once),
    print ``[index, exit status]`` per job as JSON lines."""
    import gc
    import importlib
    import signal
    import threading
    import time

    spec = json.loads(sys.stdin.read())
    _preload(importlib, threading)
    # what the import made is never garbage: kept out of every collection, a child's collections
    # neither walk it nor copy the pages they would touch (each child would, torch's objects being many)
    gc.freeze()
    jobs, workers, timeout_s = spec["jobs"], spec["workers"], spec["timeout_s"]
    waiting, running = list(enumerate(jobs)), {}  # pid -> (index, deadline)
    while waiting or running:
        while waiting and len(running) < workers:
            i, job = waiting.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _become(job)  # never returns: the child exits as `python -m` would
            running[pid] = (i, time.monotonic() + timeout_s)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            i, _ = running.pop(pid)
            print(json.dumps([str(i), os.waitstatus_to_exitcode(status)]))
            continue
        for pid, (i, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
                print(json.dumps([str(i), None]))
        time.sleep(0.01)


def _preload(importlib, threading) -> None:
    """Import PRELOAD with this process's stdout and stderr captured: a fresh process would print
    what the import prints, a fork of this one would not, so any output ends the server."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    captured = os.memfd_create("preload")
    os.dup2(captured, 1)
    os.dup2(captured, 2)
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    said = os.pread(captured, 1 << 16, 0).decode(errors="replace")
    if said:
        sys.exit(f"importing {', '.join(PRELOAD)} printed (a forked run would not):\n{said}")
    threads = len(os.listdir("/proc/self/task"))
    if threading.active_count() != 1 or threads != 1:
        sys.exit(f"importing {', '.join(PRELOAD)} left {threads} threads: a fork would have one")


def _become(job: dict) -> None:
    """In the forked child: `python -m MODULE ARGS` with the job's output files and PYTHONPATH."""
    import runpy

    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    # sys.path as the interpreter builds it for `python -m`: the working directory, then PYTHONPATH,
    # then what the server has after its own PYTHONPATH (the standard library, site-packages)
    inherited = os.environ.get("PYTHONPATH", "")
    rest = sys.path[1 + len(inherited.split(os.pathsep)) if inherited else 1 :]
    os.environ["PYTHONPATH"] = job["pythonpath"]
    sys.path[:] = [os.getcwd(), *job["pythonpath"].split(os.pathsep), *rest]
    main = sys.modules["__main__"].__dict__  # a fresh __main__: only the interpreter's own names
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    sys.argv = ["-m", *job["args"]]  # argv[0] becomes the module's path, as under `python -m`
    runpy._run_module_as_main(job["module"], alter_argv=True)
    sys.exit(0)  # the module returned: the interpreter exits 0
