"""What the fsdp_impl world tests share (test_fsdp_impl.py, test_fsdp_hybrid.py, test_fsdp_checkpoint.py),
and the report tests' stand-in plots (`fast_plots`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.execute.world import World
from harness.report import plots


@pytest.fixture
def fast_plots(monkeypatch):
    """Stand-in plot functions (PNG rendering costs ~0.3 s each)."""
    for name in ("plot_loss", "plot_diff", "plot_memory"):
        monkeypatch.setattr(plots, name, lambda *args, **_kw: Path(args[-1]).write_bytes(b"stub"))


@pytest.fixture(scope="module")
def world():
    """world(n) -> a live World of n ranks, started on first use and kept for the module."""
    live: dict[int, World] = {}

    def get(n: int) -> World:
        w = live.get(n)
        if w is None or w.closed:  # a failed task kills its world; the next test gets a new one
            w = live[n] = World(n, timeout_s=240)
        return w

    yield get
    for w in live.values():
        w.close()


def plain_runs(world, task: str):
    """run(payload) -> rank 0's result of `task` training the PLAIN model at world size 1 (cached per payload)."""
    cache: dict[str, dict] = {}

    def run(payload: dict) -> dict:
        key = json.dumps(payload, sort_keys=True)
        if key not in cache:
            cache[key] = world(1).call(task, {**payload, "wrap": False})[0]
        return cache[key]

    return run
