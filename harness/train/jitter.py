"""Timing perturbation (feature ``jitter``): seeded, bounded delays where asynchronous work races.

An implementation that overlaps communication with computation (a prefetched all-gather, a reduction
left running while backward goes on) is only right if it waits for each collective before it reads
what the collective writes, and lets nothing else depend on when a rank gets somewhere. On a quiet
machine the collectives of a small model finish in microseconds, so a missing wait goes unseen. A
``Jitter`` makes the ranks arrive at each such point at different moments: it sleeps a delay drawn
in [0, MAX_DELAY_S] from a generator keyed by (scenario seed, rank, step, index of the delay in the
step), so the ranks are delayed apart, every run alike, and the numbers must not change at all
(harness/checks/features.py ``jitter_invariant``).

Where (POINTS), from outside the implementation, so any adapter is perturbed unchanged:

    collective   before every op of a c10d namespace that communicates, as the dispatcher sees it
                 (harness.measure.comm.op_kind: all-gather, reduce-scatter, all-reduce, all-to-all, ...):
                 this rank's part arrives late, so another rank's asynchronous work on it is still in flight
    wait         before every wait on one: ``wait_tensor`` at the dispatcher, and ``Work.wait`` (the method
                 is wrapped while a Jitter is active, in every thread)
    forward      after each forward pass (the harness's step: harness/train/task.py)
    optimizer    before the optimizer step (the same)

Not reached: collectives issued from another thread than the step's (a dispatch mode is thread-local;
autograd's CPU backward runs in the calling thread and its worker threads inherit the mode), and waits
made in C++ (DDP's reducer waits on its own futures).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure.comm import DTENSOR, WhileEntered, op_kind

MAX_DELAY_S = 0.02  # the longest one delay: long beside a collective of the zoo's models (tens of microseconds)
POINTS = ("collective", "wait", "forward", "optimizer")

_LOCK = threading.Lock()
_SAVED: list[Any] = []  # Work.wait as it was, while wrapped


def delay_of(seed: int, rank: int, step: int, index: int, max_s: float = MAX_DELAY_S) -> float:
    """The `index`-th delay of `rank` at `step` under `seed`, in [0, max_s]: the same in every run and
    process (a hash, not Python's salted one), apart between ranks and points."""
    h = hashlib.blake2b(f"{seed}/{rank}/{step}/{index}".encode(), digest_size=8).digest()
    return max_s * int.from_bytes(h, "little") / 2.0**64


def _wrap_work_wait() -> None:
    from torch._C._distributed_c10d import Work

    orig = Work.__dict__["wait"]
    _SAVED.append(orig)

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        for j in list(_JITTERS.owners):
            j.pause("wait")
        return orig(self, *args, **kwargs)

    Work.wait = wait


def _unwrap_work_wait() -> None:
    from torch._C._distributed_c10d import Work

    Work.wait = _SAVED.pop()


_JITTERS = WhileEntered(_wrap_work_wait, _unwrap_work_wait)  # entered jitters: Work.wait is wrapped while there are


class Jitter(TorchDispatchMode):
    """Delays for one training step of one rank. ``with Jitter(seed, rank, step) as j: ...``; the harness
    calls ``j.pause("optimizer")`` itself and hands ``j.marking(mark)`` to the step for the forward point.
    ``counts`` (point -> delays) and ``slept`` (seconds) say what it did."""

    def __init__(self, seed: int, rank: int, step: int, max_s: float = MAX_DELAY_S) -> None:
        super().__init__()
        self.key, self.max_s = (seed, rank, step), max_s
        self.index = 0
        self.counts: Counter = Counter()
        self.slept = 0.0

    def pause(self, point: str) -> None:
        """Sleep this point's delay (the next index's)."""
        with _LOCK:
            i, self.index = self.index, self.index + 1
        delay = delay_of(*self.key, i, self.max_s)
        time.sleep(delay)
        with _LOCK:
            self.counts[point] += 1
            self.slept += delay

    def marking(self, mark: Callable) -> Callable:
        """`mark` (harness/train/features.py forward_backward's) with a delay after each forward."""

        def marked(phase: str, value=None):
            out = mark(phase, value)
            if phase == "after_forward":
                self.pause("forward")
            return out

        return marked

    @property
    def delays(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> Jitter:
        _JITTERS.enter(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _JITTERS.exit(self)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if DTENSOR is not None and DTENSOR in types:  # lowered to plain ops first; those come back here
            return NotImplemented
        kind = op_kind(func)
        if kind is not None:
            self.pause(kind)
        return func(*args, **kwargs)
