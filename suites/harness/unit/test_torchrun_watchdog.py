"""Under torchrun a stuck rank's watchdog posts its Python stack while a collective that the others skipped still
waits in it: before the subgroup's collective timeout (the scenario timeout), not at it. At the same moment the
two raced, and on a loaded machine the stack showed the timed-out collective's error path instead of the wait."""

from __future__ import annotations

import threading

from harness.execute.torchrun import TorchrunPool


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def check(self, keys):  # "finished": rank 0 is done, so the watchdog's later loop ends at once
        return True


class _StuckThenDone:
    """A scenario still running when the watchdog first looks, finished at its next look."""

    def __init__(self):
        self.waits = []

    def wait(self, timeout):
        self.waits.append(timeout)
        return len(self.waits) > 1


def test_the_watchdog_posts_the_stack_before_the_subgroups_collective_timeout():
    pool = TorchrunPool(_Store(), 1, "gloo", None, timeout_s=10.0)
    done = _StuckThenDone()
    pool._watch("run/3/", threading.main_thread().ident, done)
    assert 0 < done.waits[0] < pool.timeout_s, done.waits  # the subgroup's collectives time out at timeout_s
    assert pool.store.kv.get("run/3/stack/1"), pool.store.kv
