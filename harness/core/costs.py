"""What the harness's own work costs, by part: seconds summed per name (a rank's scenario, a run's phases).

A `Stopwatch` is cheap enough to leave on in every run (two clock reads per part); `harness.bench.harness_cost`
reads what the ranks and the phases recorded to say where a run's time went beside its bare training."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Stopwatch:
    """Seconds per named part, summed over every time the part ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
