"""How the harness's own processes start children that run its code by module name (world ranks, plot workers)."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator


@contextlib.contextmanager
def main_hidden() -> Iterator[None]:
    """Start children as if ``__main__`` were empty, so that they do not re-run the main script.

    The children find what they run by module name and never need the parent's ``__main__``; re-running it
    (multiprocessing's default) costs each child e.g. the import of pytest under the ``pytest`` console script
    (reports/performance.md#world-start), and the CLI's own start again.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def forkserver_running() -> bool:
    """Whether multiprocessing's forkserver runs for this process (started by a world: harness.execute.world).
    A child forked from it starts in milliseconds; one that would start the server itself would start it with
    whatever it preloads then, and every later world would come from that server instead of the worlds' own."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask where the system has one, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
