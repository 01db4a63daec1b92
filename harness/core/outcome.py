"""A run's outcome: the word of the report's overall line, the console's summary line and the exit
status, all read from the run's scenarios and verdicts tables (so a report re-rendered from stored
tables says what the run said).

A run verifies the implementations under test: those its scenarios ran (the `--impl` list, or the
part of it a pytest `-k` selected; the reference itself only where it is the one implementation
named). The reference's runs (impl "reference") are the yardstick they are compared with, so their
verdicts are counted apart: a run whose passes are all the reference's checked nothing. The word,
the first rule that holds:

    FAIL     a verdict failed or a scenario errored: an implementation's (one that raised in every
             scenario included: a crash is no skip), a run-wide one (the gate, the per-sample checks)
             or the reference's (a broken yardstick is no pass)
    NOT RUN  nothing failed, but an implementation under test ran no scenario to its end: every one
             was unsupported (nothing applied to it), so it was not verified, whatever the others did
    PASS     every implementation under test ran scenarios and no verdict failed

An implementation that errored names its first error (the error's own line, as the raising rank
said it) in the summary, so a run that crashed everywhere says why on its last line.

Tables with neither scenarios nor verdicts read NO VERDICTS. The gate adds what it compared: the count of
figures held against the baseline and the fields it left uncompared with why (a configuration that differs,
a baseline of another machine kind: the run-wide SKIP of each such field), or, when it compared none, its
`gate:coverage` verdict's reason (harness.gate.compare). A field whose gate is off is the user's choice and
is not repeated there.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.core.scenario import REFERENCE_IMPL
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, UNSUPPORTED

STATUSES = (PASS, FAIL, KNOWN, SKIP, UNSUPPORTED)
PASSED, FAILED, NOT_RUN, NO_VERDICTS = "PASS", "FAIL", "NOT RUN", "NO VERDICTS"
GATE_COVERAGE = "gate:coverage"  # the gate's verdict when it compared nothing (harness.gate.compare)
# the gate's run-wide notes that are not fields (harness.gate.compare)
GATE_NOTES = ("gate:scenario", "gate:env", "gate:configuration", GATE_COVERAGE)
GATE_OFF = "gate off for "  # how a field whose gate is off says so


@dataclass(frozen=True)
class ImplRuns:
    """How many scenarios of one implementation under test ran to their end, were not run
    (unsupported), or errored."""

    impl: str
    ran: int
    unsupported: int
    errored: int
    first_error: str = ""  # the error line of its first errored scenario ('' where none errored)

    def __str__(self) -> str:
        errored = f", {self.errored} errored" if self.errored else ""
        named = f" (first: {self.first_error})" if self.errored and self.first_error else ""
        return f"{self.impl}: {self.ran} ran, {self.unsupported} unsupported{errored}{named}"


@dataclass(frozen=True)
class Outcome:
    word: str
    counts: dict[str, int]  # status -> verdicts of the implementations under test and run-wide ones
    reference: dict[str, int]  # status -> verdicts of the reference's runs
    impls: tuple[ImplRuns, ...]
    errored: int  # scenarios that errored, the reference's included
    gate: str  # what the gate compared ('' without a baseline)

    @property
    def runs(self) -> str:
        """'fsdp_impl: 12 ran, 0 unsupported; torch_fsdp2: ...' ('no implementation under test' if none)."""
        return "; ".join(map(str, self.impls)) or "no implementation under test"

    @property
    def not_run(self) -> list[str]:
        """The implementations under test that ran no scenario to its end."""
        return [r.impl for r in self.impls if not r.ran]


def _cell_state(cells: pd.DataFrame) -> pd.Series:
    """'ran', 'unsupported' or 'errored' per scenario row (a table without status or error columns: ran)."""
    status = cells["status"].astype(str) if "status" in cells else pd.Series("ok", index=cells.index)
    error = cells["error"].fillna("").astype(str) if "error" in cells else pd.Series("", index=cells.index)
    errored = (error != "") & (error != "nan")
    return pd.Series(
        ["unsupported" if s == UNSUPPORTED else "errored" if e else "ran" for s, e in zip(status, errored)],
        index=cells.index,
        dtype=object,
    )


ERROR_LINE_CHARS = 160  # an error's line in the summary, cut beyond this


def error_line(text: str) -> str:
    """The line that says what an error was: after a traceback, its exception line (`RuntimeError: boom`),
    else the text's first line; cut to ERROR_LINE_CHARS."""
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    for i, ln in enumerate(lines):
        if ln.startswith("Traceback (most recent call last)"):
            line = next((later for later in lines[i + 1 :] if not later[:1].isspace()), line)
            break
    line = line.strip()
    return line if len(line) <= ERROR_LINE_CHARS else line[: ERROR_LINE_CHARS - 3] + "..."


def _first_error(cells: pd.DataFrame, state: pd.Series, impl: str) -> str:
    errors = cells.loc[(cells["impl"] == impl) & (state == "errored")]
    return error_line(errors["error"].iloc[0]) if len(errors) else ""


def _count(verdicts: pd.DataFrame) -> dict[str, int]:
    return {s: int((verdicts["status"] == s).sum()) if len(verdicts) else 0 for s in STATUSES}


def _gate(verdicts: pd.DataFrame) -> str:
    if not len(verdicts):
        return ""
    gate = verdicts[verdicts["check"].astype(str).str.startswith("gate:")]
    if not len(gate):
        return ""
    nothing = gate[gate["check"] == GATE_COVERAGE]
    if len(nothing):
        return str(nothing["message"].iloc[0])
    figures = gate[
        (gate["check"] != "gate:scenario")
        & (gate["scenario"].fillna("").astype(str) != "")
        & gate["status"].isin((PASS, FAIL))
    ]
    failed = int((figures["status"] == FAIL).sum())
    line = f"gate: {len(figures)} figures compared with the baseline, {failed} outside tolerance"
    return line + "".join(f"; {', '.join(fields)} not compared: {why}" for why, fields in _uncompared(gate).items())


def _uncompared(gate: pd.DataFrame) -> dict[str, list[str]]:
    """why -> the fields the gate left uncompared in every scenario for that reason (its run-wide SKIPs),
    a field whose gate is off aside."""
    out: dict[str, list[str]] = {}
    wide = gate[
        (gate["scenario"].fillna("").astype(str) == "") & (gate["status"] == SKIP) & ~gate["check"].isin(GATE_NOTES)
    ]
    for check, message in zip(wide["check"].astype(str), wide["message"].fillna("").astype(str)):
        field = check.removeprefix("gate:")
        if message.startswith(GATE_OFF):
            continue
        why = message.removeprefix(f"{field} not compared: ")
        out.setdefault(why, []).append(field)
    return out


def outcome(cells: pd.DataFrame, verdicts: pd.DataFrame) -> Outcome:
    """The outcome of a run with these scenario rows (the scenarios table: impl, status, error) and
    verdicts (the verdicts table: check, scenario, status, message)."""
    cells = cells if len(cells) else pd.DataFrame(columns=["scenario", "impl"])
    state = _cell_state(cells)
    named = list(dict.fromkeys(cells["impl"]))
    under_test = [i for i in named if i != REFERENCE_IMPL] or named
    yardstick = REFERENCE_IMPL if REFERENCE_IMPL not in under_test else None
    impls = tuple(
        ImplRuns(
            i,
            *(int(((cells["impl"] == i) & (state == s)).sum()) for s in ("ran", "unsupported", "errored")),
            _first_error(cells, state, i),
        )
        for i in under_test
    )
    reference_ids = set(cells.loc[cells["impl"] == yardstick, "scenario"])
    on_reference = verdicts["scenario"].isin(reference_ids) if len(verdicts) else pd.Series(dtype=bool)
    counts = _count(verdicts[~on_reference] if len(verdicts) else verdicts)
    reference = _count(verdicts[on_reference] if len(verdicts) else verdicts)
    errored = int((state == "errored").sum())
    failed = counts[FAIL] or reference[FAIL] or errored
    if not len(verdicts) and not len(cells):
        word = NO_VERDICTS
    elif failed:
        word = FAILED
    elif any(not r.ran for r in impls):
        word = NOT_RUN
    else:
        word = PASSED
    return Outcome(word, counts, reference, impls, errored, _gate(verdicts))
