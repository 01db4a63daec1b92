"""Who draws a report's plots (harness/report/drawing.py): worker processes where there are many, this process where
there are few or a function cannot be sent; the same files either way, and a failure becomes its plot's note."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.core.children import forkserver_running
from harness.report import drawing, plots
from harness.report.drawing import Plots


def write_pid(label: str, path: Path) -> None:
    """A plot that says which process drew it."""
    Path(path).write_text(f"{label} {os.getpid()}")


def broken(label: str, path: Path) -> None:
    raise ValueError(f"no finite data for {label}")


def _steps(shift: float) -> pd.DataFrame:
    return pd.DataFrame(
        {"world_size": [1, 1, 1, 2, 2, 2], "step": [1, 2, 3] * 2, "loss": [3.0, 2.5 + shift, 2.0, 3.0, 2.4, 2.1]}
    )


def _draw_all(folder: Path, n: int) -> str:
    drawn = Plots(folder, "rel")
    text = "\n".join(
        drawn.link(plots.plot_loss, f"loss-{i}{plots.SUFFIX}", f"loss {i}", _steps(i / 10), None, "t") for i in range(n)
    )
    return drawn.finish(text)


needs_two_cores = pytest.mark.skipif(drawing.workers() < 2, reason="one core: every plot is drawn in this process")


@needs_two_cores
def test_many_plots_are_drawn_by_workers_into_the_same_files(tmp_path, monkeypatch):
    n = drawing.POOL_MIN_PLOTS
    (tmp_path / "workers").mkdir()
    (tmp_path / "here").mkdir()
    by_workers = _draw_all(tmp_path / "workers", n)
    monkeypatch.setattr(drawing, "POOL_MIN_PLOTS", n + 1)  # the same plots, drawn in this process
    here = _draw_all(tmp_path / "here", n)
    assert by_workers == here == "\n".join(f"![loss {i}](rel/loss-{i}{plots.SUFFIX})" for i in range(n))
    for i in range(n):
        assert (tmp_path / "workers" / f"loss-{i}{plots.SUFFIX}").read_bytes() == (
            tmp_path / "here" / f"loss-{i}{plots.SUFFIX}"
        ).read_bytes()


@needs_two_cores
def test_workers_draw_them_and_a_failure_becomes_its_note(tmp_path):
    """And they start no forkserver: one started here would be what every later world of the process came from."""
    server_before = forkserver_running()
    drawn = Plots(tmp_path, "rel")
    n = drawing.POOL_MIN_PLOTS
    links = [drawn.link(broken if i == 3 else write_pid, f"p{i}.txt", f"plot {i}", f"label{i}") for i in range(n)]
    text = drawn.finish("\n".join(links))
    lines = text.splitlines()
    assert lines[3] == "_Plot plot 3: failed (ValueError: no finite data for label3)._"
    assert lines[0] == "![plot 0](rel/p0.txt)" and len(lines) == n
    pids = {int((tmp_path / f"p{i}.txt").read_text().split()[1]) for i in range(n) if i != 3}
    assert os.getpid() not in pids
    assert forkserver_running() == server_before


@needs_two_cores
def test_workers_draw_while_the_text_is_still_being_written(tmp_path):
    """From the POOL_MIN_PLOTS-th plot on, a plot is given to a worker when it is asked for: the files are there
    before `finish` is called."""
    n = drawing.POOL_MIN_PLOTS
    with Plots(tmp_path, "rel") as drawn:
        links = [drawn.link(write_pid, f"p{i}.txt", f"plot {i}", f"label{i}") for i in range(n + 2)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all((tmp_path / f"p{i}.txt").exists() for i in range(n + 2)):
            time.sleep(0.05)
        drawn_before = sorted(p.name for p in tmp_path.iterdir())
        text = drawn.finish("\n".join(links))
    assert drawn_before == sorted(f"p{i}.txt" for i in range(n + 2)), "plots waited for finish"
    assert text.splitlines()[-1] == f"![plot {n + 1}](rel/p{n + 1}.txt)"


def test_few_plots_or_a_function_no_worker_can_import_are_drawn_here(tmp_path):
    drawn = Plots(tmp_path, "rel")
    n = drawing.POOL_MIN_PLOTS
    here = lambda label, path: write_pid(label, path)  # noqa: E731  (a stand-in no worker can import)
    text = drawn.finish("\n".join(drawn.link(here, f"p{i}.txt", f"plot {i}", "x") for i in range(n)))
    assert text.splitlines()[-1] == f"![plot {n - 1}](rel/p{n - 1}.txt)"
    assert {int((tmp_path / f"p{i}.txt").read_text().split()[1]) for i in range(n)} == {os.getpid()}
    few = Plots(tmp_path, "rel")
    few.finish(few.link(write_pid, "one.txt", "one", "x"))
    assert int((tmp_path / "one.txt").read_text().split()[1]) == os.getpid()


def test_no_plots_folder_draws_nothing_and_says_so(tmp_path):
    drawn = Plots(None, "rel")
    assert drawn.finish(drawn.link(write_pid, "p.txt", "plot", "x")) == "_Plot plot: not drawn (--no-plots)._"
    assert not any(tmp_path.iterdir())
