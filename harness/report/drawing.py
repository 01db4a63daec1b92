"""Who draws a report's plots, and when: the sections ask for a plot and get its link at once; the plots are drawn
together once the text is done, in worker processes where there are enough of them to repay the workers' start.

A report of the main job holds some 70 plots at about a tenth of a second each (matplotlib's drawing of axes and
text, then the PNG), most of the time its rendering takes, in one process while the machine's other cores wait.
`Plots.link` returns a placeholder, `Plots.finish` draws every plot asked for and puts its link, or a note saying
why it failed, in the placeholder's place; a plot that fails never loses the report. Drawn in workers, each plot is
the same function with the same data as drawn here (the figures are the same files); a function that cannot be sent
to a worker (a stand-in a test made) is drawn here, as every plot is where there are few.
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
    (--no-plots), and the report says so where each would be."""

    def __init__(self, folder: Path | None, rel: str):
        self.folder, self.rel = folder, rel
        self._jobs: list[_Job] = []

    def link(self, fn: Callable, name: str, alt: str, *args, **kwargs) -> str:
        """The markdown where plot `name` goes: `fn(*args, <folder>/<name>, **kwargs)` draws it (at `finish`)."""
        if self.folder is None:
            return f"_Plot {alt}: not drawn (--no-plots)._"
        token = f"\x00plot{len(self._jobs)}\x00"
        self._jobs.append(_Job(token, fn, self.folder / name, alt, args, kwargs))
        return token

    def finish(self, text: str) -> str:
        """`text` with every plot drawn and its placeholder replaced by its link or a note of its failure."""
        jobs, self._jobs = self._jobs, []
        errors = _draw_in_workers(jobs) if _worth_workers(jobs) else None
        if errors is None:
            errors = [_draw(job.fn, job.path, job.args, job.kwargs) for job in jobs]
        for job, error in zip(jobs, errors):
            text = text.replace(job.token, self._said(job, error))
        return text

    def _said(self, job: _Job, error: str | None) -> str:
        if error is not None:
            return f"_Plot {job.alt}: failed ({error})._"
        return f"![{job.alt}]({self.rel}/{job.path.name})"


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


def _worth_workers(jobs: list[_Job]) -> bool:
    """Enough plots, more than one core, and every plotting function one a worker can import by name."""
    if len(jobs) < POOL_MIN_PLOTS or workers() < 2:
        return False
    try:
        for fn in {id(job.fn): job.fn for job in jobs}.values():
            pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False
    return True


def _start_method() -> str:
    """The worlds' forkserver where it runs (its children start at once); else spawn: a forkserver started here
    would be the one every later world of this process came from (harness.execute.world preloads its own)."""
    return "forkserver" if forkserver_running() else "spawn"


def _draw_in_workers(jobs: list[_Job]) -> list[str | None] | None:
    """Each job's failure (None: drawn) from a pool of worker processes; None where the pool could not be used
    (the caller then draws every plot itself). A Ctrl-C cancels what has not started and waits for the rest."""
    try:
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=min(workers(), len(jobs)), mp_context=multiprocessing.get_context(_start_method())
        )
    except (OSError, ValueError, RuntimeError):
        return None
    try:
        with main_hidden():  # the workers start at the first submit
            futures = [pool.submit(_draw, job.fn, job.path, job.args, job.kwargs) for job in jobs]
        return [f.result() for f in futures]
    except concurrent.futures.process.BrokenProcessPool:
        return None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
