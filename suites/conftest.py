"""What the suite's files share within one pytest process (one xdist worker): `kept_worlds`, `world`, one
intra-op thread, and the tiers (`--ci`, `--slow`: suites/tiers.py)."""

from __future__ import annotations

import pytest
import torch

from harness.execute.world import World
from suites.tiers import add_options, skip_by_tier

# The tests that compute in the pytest process itself (models trained in-process, the unit tests of the
# checks and tables) share the machine with the other xdist worker and with the ranks of the worlds the
# tests start: with torch's default of one intra-op thread per core, its threads wait for each other on busy
# cores. One thread: test_models.py took 6.4 CPU seconds instead of 27.8 on 2 busy cores. Only this
# process: the processes the tests start keep their own settings (the harness's ranks and CLI set theirs).
torch.set_num_threads(1)


def pytest_addoption(parser):
    add_options(parser)


def pytest_collection_modifyitems(config, items):
    skip_by_tier(config, items)


@pytest.fixture(scope="session")
def kept_worlds():
    """One WorldPool that keeps a world per size for the whole session (harness.execute.world.WorldPool,
    keep=True): the files that run matrices each go through W = 1, 2, 4 (8) in turn, and each world's
    start and its workers' first-use costs (imports, caches of the first step) are paid once per pytest
    process rather than once per file. A test that breaks a world gets it rebuilt on the next use; a test
    that counts the worlds it starts, or kills them on purpose, keeps a pool of its own."""
    from harness.execute.world import WorldPool

    with WorldPool(keep=True) as pool:
        yield pool


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
