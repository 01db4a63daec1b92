"""Gate tolerances: which fields the gate compares, how much each may move, and the --gate spec.

Gate fields and their default tolerances (override with parse_gate):

    loss        per-step global loss, any direction            1e-7 absolute (about 1 fp32 ulp at 1.0)
    max_diff    final max |param diff| vs reference and 1 rank 10%, increases only (0 stays 0: exact)
    peak_mem    peak bytes per rank                            5% (at least 4096 B), increases only
    state_mem   params+grads+optimizer bytes per rank          1%, increases only
    comm_bytes  bytes moved per step (all collectives)         0, any direction
    comm_calls  collective calls per step                      0, any direction
    step_time   seconds per step                               off (timing is noisy on shared CPUs)

Peak memory on gloo is not exactly repeatable: gloo's worker thread drops its reference to a
collective's buffers after the caller's ``wait()`` returns, so whether one such buffer is still
alive at the step's peak is a race, seen for fsdp_impl and FSDP2 alike
(reports/measured_behaviour.md#peak-memory-on-gloo). The peak_mem tolerance has an absolute floor for that
reason.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


class GateSpecError(ValueError, argparse.ArgumentTypeError):
    """A bad --gate spec (a ValueError that argparse also prints verbatim)."""


@dataclass(frozen=True)
class Tolerance:
    value: float = 0.0  # absolute, or a fraction of |baseline| when relative
    relative: bool = False
    off: bool = False
    floor: float = 0.0  # a relative tolerance allows at least this much (absolute)

    def allowed(self, base: float) -> float:
        return max(self.value * abs(base), self.floor) if self.relative else self.value

    def fails(self, current: float, base: float, two_sided: bool = True) -> bool:
        delta = current - base
        return not self.off and (abs(delta) if two_sided else delta) > self.allowed(base)

    def __str__(self) -> str:
        if self.off:
            return "off"
        if not self.relative:
            return f"{self.value:g}"
        return f"{self.value * 100:g}%" + (f"min{self.floor:g}" if self.floor else "")


# field -> (default tolerance, two-sided?)
FIELDS: dict[str, tuple[Tolerance, bool]] = {
    "loss": (Tolerance(1e-7), True),
    "max_diff": (Tolerance(0.10, relative=True), False),
    "peak_mem": (Tolerance(0.05, relative=True, floor=4096), False),
    "state_mem": (Tolerance(0.01, relative=True), False),
    "comm_bytes": (Tolerance(0), True),
    "comm_calls": (Tolerance(0), True),
    "step_time": (Tolerance(off=True), False),
}
DEFAULT_TOLERANCES = {f: t for f, (t, _) in FIELDS.items()}


def parse_gate(spec: str) -> dict[str, Tolerance]:
    """'loss:1e-7,peak_mem:5%,step_time:off' -> every field's Tolerance (defaults for fields not named).

    A percentage may carry an absolute minimum: 'peak_mem:5%min4096' allows max(5%, 4096); without
    one it keeps the field's default minimum ('peak_mem:5%' still allows 4096 B; '5%min0' drops it)."""
    out, seen = dict(DEFAULT_TOLERANCES), set()
    for item in filter(None, (p.strip() for p in (spec or "").split(","))):
        field, sep, raw = (s.strip() for s in item.partition(":"))
        if not sep or not raw:
            raise GateSpecError(f"gate item '{item}' must be FIELD:TOLERANCE, e.g. loss:1e-7 or peak_mem:5%")
        if field not in FIELDS:
            raise GateSpecError(f"unknown gate field '{field}' (known: {', '.join(FIELDS)})")
        if field in seen:
            raise GateSpecError(f"gate field '{field}' given twice")
        seen.add(field)
        if raw.lower() == "off":
            out[field] = Tolerance(off=True)
            continue
        num, _, floor_s = raw.lower().partition("min")
        pct = num.endswith("%")
        try:
            value = float(num[:-1] if pct else num)
            floor = float(floor_s) if floor_s else 0.0
        except ValueError:
            value = floor = math.nan
        if not (math.isfinite(value) and math.isfinite(floor)) or value < 0 or floor < 0 or (floor_s and not pct):
            raise GateSpecError(
                f"gate '{item}': '{raw}' is not a number >= 0, a percentage like 5% "
                f"(optionally with a minimum, 5%min4096), or 'off'"
            )
        if pct and not floor_s:  # '5%' alone keeps the field's own floor (peak_mem: 4096 B, see above)
            floor = DEFAULT_TOLERANCES[field].floor
        out[field] = Tolerance(value / 100 if pct else value, relative=pct, floor=floor)
    return out
