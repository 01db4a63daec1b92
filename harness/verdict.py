"""The one result type shared by the pytest suites, the report and the regression gate."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# status values
PASS = "pass"
FAIL = "fail"
KNOWN = "known"  # a documented deviation of a real implementation (see harness/policy.py): shown, never hidden
SKIP = "skip"  # the check does not apply to this scenario (the reason is in `message`)


@dataclass(frozen=True)
class Verdict:
    check: str  # stable check name, e.g. "ws1_exact", "cross_ws_replicated"
    scenario: str  # Scenario.id (or "" for run-wide checks)
    status: str  # PASS | FAIL | KNOWN | SKIP
    measured: float | None  # the measured figure (e.g. max |param diff|)
    bound: float | None  # the bound it was held against
    where: str = ""  # first step / parameter where the bound was crossed, e.g. "step 3, layers.1.w2.weight"
    message: str = ""  # one human sentence: what was measured, against what, and why it matters

    @property
    def passed(self) -> bool:
        return self.status in (PASS, KNOWN, SKIP)

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        return f"[{self.status.upper()}] {self.check} {self.scenario}{loc}: {self.message}"
