"""What the suite's files share within one pytest process (one xdist worker): `kept_worlds`."""

from __future__ import annotations

import pytest


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
