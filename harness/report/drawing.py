"""Who draws a report's plots, and when: the sections ask for a plot and get its link at once; the plots are drawn
by worker processes while the rest of the text is written, where there are enough of them to repay the workers'
start.

A report of the main job holds dozens of plots (matplotlib's drawing of axes and text, then the file), most of
the time its rendering takes, in one process while the machine's other cores wait.
`Plots.link` returns a placeholder and, from the POOL_MIN_PLOTS-th plot on, gives the plot to a worker; `Plots.finish`
waits for every plot (drawing here those no worker took) and puts its link, or a note saying why it failed, in the
placeholder's place; a plot that fails never loses the report. Drawn in workers, each plot is the same function
with the same data as drawn here (the figures are the same files); a function that cannot be sent to a worker (a
stand-in a test made) is drawn here, as every plot is where there are few.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.core.children import forkserver_running, main_hidden, usable_cpus

# at least this many plots before workers draw them: a worker's start (its imports of pandas and matplotlib)
# costs about what a few plots do
POOL_MIN_PLOTS = 12
MAX_WORKERS = 8


@dataclass
class _Job:
    token: str
    fn: Callable
    path: Path
    alt: str
    args: tuple
    kwargs: dict


class Plots:
    """The plots of one report: drawn into `folder` and linked as `rel/<file>`; `folder` None: none drawn
    (--no-plots), and the report says so where each would be. Once there are enough plots to repay the workers'
    start, each is given to a worker as soon as it is asked for, and drawn while the rest of the text is written."""

    def __init__(self, folder: Path | None, rel: str):
        self.folder, self.rel = folder, rel
        self._jobs: list[_Job] = []
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._given: list[concurrent.futures.Future | None] = []  # per job given out: its worker's, None: drawn here
        self._no_pool = False  # a pool could not be made: every plot is drawn here

    def link(self, fn: Callable, name: str, alt: str, *args, **kwargs) -> str:
        """The markdown where plot `name` goes: `fn(*args, <folder>/<name>, **kwargs)` draws it (in a worker from
        now on, or at `finish`)."""
        if self.folder is None:
            return f"_Plot {alt}: not drawn (--no-plots)._"
        token = f"\x00plot{len(self._jobs)}\x00"
        self._jobs.append(_Job(token, fn, self.folder / name, alt, args, kwargs))
        self._give_out()
        return token

    def _give_out(self) -> None:
        if self._pool is None:
            if self._no_pool or len(self._jobs) < POOL_MIN_PLOTS or workers() < 2:
                return
            self._pool = _worker_pool()
            if self._pool is None:
                self._no_pool = True
                return
        for job in self._jobs[len(self._given) :]:
            self._given.append(_give(self._pool, job))

    def finish(self, text: str) -> str:
        """`text` with every plot drawn and its placeholder replaced by its link or a note of its failure."""
        jobs, given = self._jobs, self._given + [None] * (len(self._jobs) - len(self._given))
        try:
            errors = [_outcome(job, future) for job, future in zip(jobs, given)]
        finally:
            self.close()
        for job, error in zip(jobs, errors):
            text = text.replace(job.token, self._said(job, error))
        return text

    def close(self) -> None:
        """Stop the workers: a plot not started is not drawn (the report was abandoned, or every plot is done)."""
        self._jobs, self._given = [], []
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Plots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _said(self, job: _Job, error: str | None) -> str:
        if error is not None:
            return f"_Plot {job.alt}: failed ({error})._"
        return f"![{job.alt}]({self.rel}/{job.path.name})"


def _outcome(job: _Job, future: concurrent.futures.Future | None) -> str | None:
    """A job's failure (None: drawn): its worker's answer, or drawn here (a job no worker took, a pool broken)."""
    if future is not None:
        try:
            return future.result()
        except concurrent.futures.process.BrokenProcessPool:
            pass
    return _draw(job.fn, job.path, job.args, job.kwargs)


def _draw(fn: Callable, path: Path, args: tuple, kwargs: dict) -> str | None:
    """Draw one plot; None, or the failure in one line (a broken plot must not lose the report)."""
    try:
        fn(*args, path, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def workers() -> int:
    """The cores this process may use, at most MAX_WORKERS: how many workers draw."""
    cores = usable_cpus()
    return max(1, min(MAX_WORKERS, cores))


def _give(pool: concurrent.futures.ProcessPoolExecutor, job: _Job) -> concurrent.futures.Future | None:
    """A worker's future for `job`; None where a worker cannot import its function (a stand-in a test made)."""
    try:
        pickle.dumps(job.fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        return None
    with main_hidden():  # a worker may start at this submit
        return pool.submit(_draw, job.fn, job.path, job.args, job.kwargs)


def _start_method() -> str:
    """The worlds' forkserver where it runs (its children start at once); else spawn: a forkserver started here
    would be the one every later world of this process came from (harness.execute.world preloads its own)."""
    return "forkserver" if forkserver_running() else "spawn"


def _worker_pool() -> concurrent.futures.ProcessPoolExecutor | None:
    """A pool of `workers()` processes; None where one cannot be made (every plot is then drawn here)."""
    try:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=workers(), mp_context=multiprocessing.get_context(_start_method())
        )
    except (OSError, ValueError, RuntimeError):
        return None
