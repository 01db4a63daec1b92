"""`python -m suites.faults.paused_cli MODULE:FUNCTION MARKER ARGS...`: `python -m harness ARGS...`
with MODULE.FUNCTION replaced by `pause`, which creates the file MARKER and then sleeps until a
signal ends the process. For the Ctrl-C tests of moments that nothing outside the process shows,
or too briefly to catch: the gate (it compares tables in memory) and a world worker that has not
reached its entry point (`harness.execute.worker:main`, which the parent pickles by reference, so
the worker runs `pause` with the signal dispositions of multiprocessing's bootstrap). The harness
itself has no test hook; FUNCTION must be looked up in its module where it is called. With `--threaded` first,
the process starts a thread of its own before anything else (as a program or a pytest-xdist worker has one).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from pathlib import Path

THREADED = "--threaded"
MARKER = "FSDP_HARNESS_TEST_PAUSED_MARKER"  # set here, inherited by the forkserver and its workers


def pause(*_args, **_kwargs) -> None:
    """Stands in for the paused function: says it was reached, then waits for a signal."""
    Path(os.environ[MARKER]).touch()
    while True:
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    if argv[0] == THREADED:  # a thread of its own before the first world: the forkserver is executed, not forked
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        argv = argv[1:]
    target, marker, *args = argv
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    getattr(module, name)  # a name that does not exist is a broken test, not a run that never pauses
    os.environ[MARKER] = marker
    setattr(module, name, pause)
    from harness.cli import main as cli

    return cli(args)


if __name__ == "__main__":
    from suites.faults import paused_cli  # `pause` pickled by reference: as this module's, not __main__'s

    sys.exit(paused_cli.main(sys.argv[1:]))
