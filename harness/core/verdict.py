"""The one result type shared by the pytest suites, the report and the regression gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# status values
PASS = "pass"
FAIL = "fail"  # the property was measured and does not hold, or it could not be measured at all
KNOWN = "known"  # a documented deviation of a real implementation (see harness/core/policy.py): shown, never hidden
SKIP = "skip"  # the check does not apply to this scenario (the reason is in `message`); never "could not run"
# the scenario was not run: its feature needs an adapter method the implementation does not have
# (harness/adapters/base.py). Not a pass and not a failure: counted and shown apart from both
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class Verdict:
    check: str  # stable check name, e.g. "ws1_exact", "cross_ws_replicated"
    scenario: str  # Scenario.id (or "" for run-wide checks)
    status: str  # PASS | FAIL | KNOWN | SKIP | UNSUPPORTED
    measured: float | None  # the measured figure (e.g. max |param diff|)
    bound: float | None  # the bound it was held against
    where: str = ""  # display only: a short phrase on the place or quantity (never parsed back)
    message: str = ""  # one human sentence: what was measured, against what, and why it matters
    step: int | None = None  # the first step where the bound was crossed (None: not a per-step figure)
    param: str = ""  # the parameter (module path of the unwrapped model) where it was crossed
    rank: int | None = None  # the rank where it was crossed, when one rank is to blame
    sample: int | None = None  # the sample of the global batch (per-sample gradient norms)

    @property
    def passed(self) -> bool:
        """PASS, a documented deviation, or not applicable. A check that could not run is a FAIL."""
        return self.status in (PASS, KNOWN, SKIP)

    @property
    def location(self) -> str:
        """'step 3, fc2.weight, rank 1 (detail)': the fields in reading order, then `where`."""
        parts = [
            f"step {self.step}" if self.step is not None else "",
            self.param,
            f"sample {self.sample}" if self.sample is not None else "",
            f"rank {self.rank}" if self.rank is not None else "",
        ]
        head = ", ".join(p for p in parts if p)
        if head and self.where:
            return f"{head} ({self.where})"
        return head or self.where

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        loc = self.location
        return f"[{self.status.upper()}] {self.check} {self.scenario}{' at ' + loc if loc else ''}: {self.message}"


VERDICT_COLUMNS = [f.name for f in fields(Verdict)]
