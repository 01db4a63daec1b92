"""What the fsdp_impl world tests share (test_fsdp_impl.py, test_fsdp_hybrid.py, test_fsdp_checkpoint.py)."""

from __future__ import annotations

import json

import pytest

from harness.execute.world import World


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
