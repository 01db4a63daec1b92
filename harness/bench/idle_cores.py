"""How much of the machine a run leaves idle, and where: `python -m harness run` with the given options, the
machine's idle core-seconds (from /proc/stat, Linux) between one line of its output and the next.

    python -m harness.bench.idle_cores --world-sizes 1,2,4,8 --per-sample     # any `harness run` options

Prints each line of the run's output with the seconds since launch, the seconds since the line before and the idle
core-seconds of the machine in between (of the core-seconds it had), then the totals. Idle cores while the harness
waits are what running its work side by side can win (the tables built while the ranks train, worlds of one size
side by side: harness.execute.executor); the figures count the whole machine, so run it on a quiet one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from harness import options as opt

STAT = "/proc/stat"


class CpuSeconds(NamedTuple):
    """Core-seconds of the whole machine since boot: idle (iowait included); stolen (a virtual machine's cores
    running another guest: time this machine's work waited without being idle); all of them."""

    idle: float
    steal: float
    total: float

    def __sub__(self, other: CpuSeconds) -> CpuSeconds:  # type: ignore[override]
        return CpuSeconds(*(a - b for a, b in zip(self, other)))


def cpu_seconds(line: str | None = None) -> CpuSeconds:
    """The machine's core-seconds since boot, from the first line of /proc/stat (`line`: that line, given)."""
    if line is None:
        with open(STAT) as f:
            line = f.readline()
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user and nice already]
    fields = [int(v) for v in line.split()[1:9]] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    return CpuSeconds((fields[3] + fields[4]) / hz, fields[7] / hz, sum(fields[:8]) / hz)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # the run's options, checked here as `harness run` checks them (a usage error before anything starts)
    opt.run_options_parser("python -m harness.bench.idle_cores", __doc__.splitlines()[0]).parse_args(args)
    if not os.path.exists(STAT):
        print(f"{STAT} not found: this bench reads the machine's idle time from Linux's /proc", file=sys.stderr)
        return 2
    lines: list[tuple[float, tuple[float, float], str]] = []
    t0, first = time.monotonic(), cpu_seconds()
    run = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )

    def read() -> None:
        for line in run.stdout:
            lines.append((time.monotonic() - t0, cpu_seconds(), line.rstrip()))

    reader = threading.Thread(target=read)
    reader.start()
    status = run.wait()
    reader.join()
    last = cpu_seconds()
    wall = time.monotonic() - t0
    print(f"{'at s':>7} {'+s':>6} {'idle':>6} {'of':>6}  line")
    prev_t, prev = 0.0, first
    for t, now, line in lines:
        print(f"{t:>7.1f} {t - prev_t:>6.1f} {now.idle - prev.idle:>6.1f} {now.total - prev.total:>6.1f}  {line[:100]}")
        prev_t, prev = t, now
    d = last - first
    print(
        f"\n{wall:.1f} s wall; the machine idle {d.idle:.1f} of {d.total:.1f} core-seconds ({d.idle / d.total:.0%}), "
        f"{d.steal:.1f} stolen by the host"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
