"""The one comparison of a run with a baseline, and its two views.

`comparison()` is the one comparison; the gate's verdicts (`compare`) and the `compare` command's
table (`compare_table`) are two views of its rows: "gate:<field>" per scenario x field (a field
whose gate is off gets one run-wide SKIP instead), "gate:scenario" SKIP for a scenario on one side
only (a run of part of the matrix is gated on what it ran), FAIL for a scenario that ran in the
baseline and errored now, "gate:env" SKIP notes, one per differing environment key (keys in
VOLATILE_ENV such as date and git_commit are ignored), and "gate:configuration" SKIP notes, one per
configuration field that differs or that either side did not record (harness.gate.configuration),
so the differences are always visible; and where no figure was compared at all, one "gate:coverage"
verdict that says why (a SKIP, a FAIL under --gate-strict).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.core.outcome import GATE_COVERAGE, GATE_OFF
from harness.core.verdict import FAIL, PASS, SKIP, Verdict
from harness.gate import configuration as config
from harness.gate.baseline import Baseline, load_baseline, summarize
from harness.gate.machine import KERNEL_DEPENDENT, env_warnings, kernel_mismatch
from harness.gate.tolerance import DEFAULT_TOLERANCES, FIELDS, Tolerance


def _elements(field: str, e: dict) -> list[tuple[int | None, str, float | None]]:
    """(step, label, value) of one field of one scenario entry: a value per step for the loss."""
    if field == "loss":
        first = int(e.get("first_step") or 1)
        return [(first + i, f"step {first + i}", v) for i, v in enumerate(e["loss"])]
    if field == "max_diff":
        return [(None, "vs reference", e["max_diff_ref"]), (None, "vs 1 rank", e["max_diff_ws1"])]
    return [(None, "", e[field])]


@dataclass(frozen=True)
class GateRow:
    """One scenario x field of the comparison (or a run-wide note): the gate's verdicts and the
    `compare` command's table are two views of the same rows."""

    check: str  # "gate:<field>", "gate:scenario" or "gate:env"
    scenario: str
    status: str
    message: str
    baseline: float | None = None
    current: float | None = None
    delta: float | None = None  # the change held against the tolerance (one-sided fields: increase only)
    allowed: float | None = None
    tolerance: str = ""
    step: int | None = None
    label: str = ""  # display: "vs reference", the environment key, ...

    def verdict(self) -> Verdict:
        return Verdict(
            self.check,
            self.scenario,
            self.status,
            self.delta,
            self.allowed,
            where=self.label if self.step is None else "",
            message=self.message,
            step=self.step,
        )


def _field(field: str, sid: str, base: dict, cur: dict, tol: Tolerance) -> GateRow:
    """The comparison of one field of one scenario: the first element over tolerance, else the closest."""
    two_sided = FIELDS[field][1]
    b_el, c_el = _elements(field, base), _elements(field, cur)
    head, check, tol_s = f"{field} of {sid}", f"gate:{field}", str(tol)
    if len(b_el) != len(c_el):
        return GateRow(
            check,
            sid,
            FAIL,
            f"{head}: {len(b_el)} values in baseline, {len(c_el)} now",
            len(b_el),
            len(c_el),
            tolerance=tol_s,
        )
    worst = None
    for (step, label, b), (*_, c) in zip(b_el, c_el):
        if b is None or c is None:
            if b is not None:
                return GateRow(
                    check,
                    sid,
                    FAIL,
                    f"{head}: baseline has {b}, this run did not measure it",
                    b,
                    tolerance=tol_s,
                    step=step,
                    label=label,
                )
            continue
        delta = c - b if not two_sided else abs(c - b)
        item = (step, label, b, c, delta, tol.allowed(b))
        if tol.fails(c, b, two_sided):
            worst = item
            break
        worst = max(worst or item, item, key=lambda t: t[4] - t[5])
    if worst is None:
        return GateRow(
            check, sid, SKIP, f"{head}: not measured in the baseline (re-save it to gate this field)", tolerance=tol_s
        )
    step, label, b, c, delta, allowed = worst
    loc = f" at {label}" if step is not None else f" ({label})" if label else ""
    tol_s = f"{tol} (= {allowed:g})" if tol.relative else tol_s
    failed = tol.fails(c, b, two_sided)
    msg = (
        f"{head} regressed{loc}: baseline {b:.10g}, current {c:.10g}, change {c - b:+.3g} exceeds tolerance {tol_s}"
        if failed
        else f"{head} within tolerance {tol_s}{loc}: baseline {b:.10g}, current {c:.10g}"
    )
    return GateRow(
        check,
        sid,
        FAIL if failed else PASS,
        msg,
        b,
        c,
        delta,
        allowed,
        str(tol),
        step if failed or delta else None,
        label if failed or delta else "",
    )


def _resolve(tolerances: dict | None) -> dict[str, Tolerance]:
    unknown = set(tolerances or {}) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown gate fields {sorted(unknown)} (known: {', '.join(FIELDS)})")
    return {**DEFAULT_TOLERANCES, **(tolerances or {})}


def _configuration(base: Baseline, current: dict | None) -> tuple[list[GateRow], dict[str, str]]:
    """(the gate:configuration notes, gate field -> why it is not compared) for a baseline and this
    run's configuration (`configuration.configuration_of`; None: not known, nothing is said)."""
    if current is None:
        return [], {}
    if base.configuration is None:
        return [
            GateRow(
                "gate:configuration",
                "",
                SKIP,
                (
                    f"baseline '{base.name}' does not record the configuration it was run with (saved before baselines "
                    f"did): scenarios are compared by id as if both runs had the same lr, steps and global batch; "
                    f"re-save it (--save-baseline {base.name}) to have that checked"
                ),
            )
        ], {}
    differ, unknown = config.differences(base.configuration, current)
    rows = []
    for d in differ:
        why = (
            f"{', '.join(config.AFFECTS[d.field])} not compared (scenario ids do not name the {d.field}: the "
            f"same id trained another way; re-save the baseline with this configuration to gate them)"
            if d.setting
            else "only the scenarios both runs have are compared"
        )
        rows.append(GateRow("gate:configuration", "", SKIP, f"configuration differs: {d}: {why}", label=d.field))
    for field in unknown:
        side = "this run" if current.get(field) is None else f"baseline '{base.name}'"
        rows.append(
            GateRow(
                "gate:configuration",
                "",
                SKIP,
                f"configuration: {side} does not record {field}: compared as if it were the same",
                label=field,
            )
        )
    skipped = {
        f: f"{f} not compared: configuration differs ({'; '.join(map(str, ds))})"
        for f, ds in config.affected(differ).items()
    }
    return rows, skipped


def comparison(
    current: dict[str, dict],
    env: dict | None,
    base: Baseline,
    tolerances: dict | None = None,
    configuration: dict | None = None,
    *,
    strict: bool = False,
) -> list[GateRow]:
    """The one comparison of a run's per-scenario figures (`summarize`) with a baseline.

    Rules, the same for the gate and for `compare`: an environment key that differs is a SKIP note
    (gate:env); a field whose gate is off is one run-wide SKIP; a configuration field that differs
    is a SKIP note (gate:configuration), and a setting the scenario ids do not name (lr, steps,
    global batch) makes the fields it changes one run-wide SKIP each, never a regression; losses and
    diffs are compared only on the same numeric kernels (`kernel_mismatch`); a scenario present on
    one side only is a SKIP that names it (a run of part of the matrix is gated on the part it
    ran); a scenario that ran in the baseline and errored now is a FAIL. `configuration` is this
    run's (`configuration.configuration_of`); None leaves it unchecked.

    A gate that compared no figure at all says so in one run-wide `gate:coverage` verdict with the
    reason: a SKIP, or with `strict` (--gate-strict) a FAIL, since such a gate checked nothing."""
    rows = _rows(current, env, base, _resolve(tolerances), configuration)
    compared = [r for r in rows if r.scenario and r.check != "gate:scenario" and r.status in (PASS, FAIL)]
    if compared:
        return rows
    why = f"the gate compared nothing with baseline '{base.name}': {_nothing_because(rows, current, base)} " + (
        "(--gate-strict: a gate that compares nothing fails)" if strict else "(--gate-strict makes this a failure)"
    )
    return rows + [GateRow(GATE_COVERAGE, "", FAIL if strict else SKIP, why)]


def _nothing_because(rows: list[GateRow], current: dict[str, dict], base: Baseline) -> str:
    """Why a comparison compared no figure, in one phrase."""
    if not base.comparable:
        return f"it has no file comparable with this machine kind ({base.wanted_kind})"
    common = [s for s in current if s in base.scenarios]
    if not common:
        return "no scenario of this run is in it"
    if not any(current[s]["status"] == "ok" and base.scenarios[s]["status"] == "ok" for s in common):
        return "no scenario ran to its end in both"
    reasons = [r.message for r in rows if not r.scenario and r.check[5:] in FIELDS and "gate off" not in r.message]
    return "every field was off or left uncompared" + (f" ({reasons[0]})" if reasons else "")


def _rows(
    current: dict[str, dict], env: dict | None, base: Baseline, tols: dict[str, Tolerance], configuration: dict | None
) -> list[GateRow]:
    """`comparison`'s rows, before it says whether anything was compared."""
    if not base.comparable:
        why = (
            f"baseline '{base.name}' has no file for this machine kind ({base.wanted_kind}) nor for another "
            f"CPU kind with this device and torch version: nothing was gated (torch's own implementations "
            f"move memory and traffic between versions; save one with --save-baseline {base.name})"
        )
        return [GateRow(f"gate:{f}", "", SKIP, why) for f, t in tols.items() if not t.off]
    rows = [GateRow("gate:env", "", SKIP, msg, label=k) for k, msg in env_warnings(env, base)]
    rows += [
        GateRow(f"gate:{f}", "", SKIP, f"{GATE_OFF}{f} (enable with e.g. {f}:50%)") for f, t in tols.items() if t.off
    ]
    notes, differs = _configuration(base, configuration)
    rows += notes + [GateRow(f"gate:{f}", "", SKIP, why) for f, why in differs.items() if not tols[f].off]
    tols = {f: t for f, t in tols.items() if f not in differs}
    mismatch = kernel_mismatch(env, base)
    if mismatch:
        rows += [GateRow(f"gate:{f}", "", SKIP, mismatch) for f in KERNEL_DEPENDENT if f in tols and not tols[f].off]
        tols = {f: t for f, t in tols.items() if f not in KERNEL_DEPENDENT}
    for sid in list(base.scenarios) + [s for s in current if s not in base.scenarios]:
        if sid not in current:
            rows.append(
                GateRow(
                    "gate:scenario",
                    sid,
                    SKIP,
                    f"scenario {sid} is in baseline '{base.name}' but not in this run: not compared",
                )
            )
        elif sid not in base.scenarios:
            rows.append(
                GateRow(
                    "gate:scenario",
                    sid,
                    SKIP,
                    f"new scenario {sid} is not in baseline '{base.name}': "
                    "not gated (re-save the baseline to cover it)",
                )
            )
        elif current[sid]["status"] != "ok" and base.scenarios[sid]["status"] == "ok":
            what = (
                "is unsupported in this run: the implementation lost what its feature needs"
                if current[sid]["status"] == "unsupported"
                else "errored in this run"
            )
            rows.append(GateRow("gate:scenario", sid, FAIL, f"scenario {sid} {what}"))
        else:
            rows += [_field(f, sid, base.scenarios[sid], current[sid], t) for f, t in tols.items() if not t.off]
    return rows


def compare(
    tables: dict,
    baseline: Baseline | str | Path,
    tolerances: dict | None = None,
    *,
    env: dict | None = None,
    strict: bool = False,
) -> list[Verdict]:
    """Gate verdicts for this run's tables against `baseline` (see `comparison`)."""
    base = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    rows = comparison(summarize(tables), env, base, tolerances, config.configuration_of(tables, env), strict=strict)
    return [r.verdict() for r in rows]


COMPARE_COLUMNS = [
    "check",
    "scenario",
    "status",
    "baseline",
    "current",
    "delta",
    "allowed",
    "tolerance",
    "step",
    "label",
    "message",
]


def compare_table(
    tables: dict,
    baseline: Baseline | str | Path,
    tolerances: dict | None = None,
    *,
    env: dict | None = None,
    strict: bool = False,
) -> pd.DataFrame:
    """The same comparison as `compare`, side by side: one row per scenario x field (a = this run)."""
    base = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    rows = comparison(summarize(tables), env, base, tolerances, config.configuration_of(tables, env), strict=strict)
    return pd.DataFrame([{c: getattr(r, c) for c in COMPARE_COLUMNS} for r in rows], columns=COMPARE_COLUMNS)
