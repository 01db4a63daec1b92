"""The report's verdict sections: the overall line, the verdict summary by kind (correctness,
efficiency, regression gate), each failure with where it diverged and its per-step trace, the
known deviations with their cause, and the skipped checks."""

from __future__ import annotations

import pandas as pd

from harness.core.outcome import outcome
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, UNSUPPORTED, Verdict
from harness.report.formatting import md_table, missing, num, ratio
from harness.report.groups import table_or_empty

STATUS_ORDER = {FAIL: 0, KNOWN: 1, UNSUPPORTED: 2, PASS: 3, SKIP: 4}
MAX_SUMMARY_ROWS = 40


def overall_line(verdicts: pd.DataFrame, cells: pd.DataFrame) -> str:
    """The overall line: the run's word (harness.core.outcome), the verdicts of the implementations
    under test, the reference's apart, how many scenarios of each implementation ran, the gate."""
    o = outcome(cells, verdicts)
    n, ref = o.counts, o.reference
    unsupported = f" / {n[UNSUPPORTED]} unsupported (not run)" if n[UNSUPPORTED] else ""
    errored = f"; {o.errored} scenario(s) errored" if o.errored else ""
    reference = (
        f" The reference's runs, the yardstick, apart: {ref[PASS]} passed / {ref[FAIL]} failed."
        if sum(ref.values())
        else ""
    )
    gate = f" {o.gate[0].upper()}{o.gate[1:]}." if o.gate else ""
    return (
        f"**Overall: {o.word}** — {n[PASS]} passed / {n[FAIL]} failed / {n[KNOWN]} known deviations{unsupported} "
        f"({n[SKIP]} skipped; {len(cells)} scenarios{errored}). Implementations under test: {o.runs}."
        f"{reference}{gate}"
    )


# the per-step |param diff| column each numeric check holds against its bound
DIFF_COLUMN = {
    "ws1_exact": "max_diff_ref",
    "cross_ws_replicated": "max_diff_ws1",
    "split_matches_full_batch": "max_diff_ref",
}


def _int_or_none(x) -> int | None:
    return None if missing(x) else int(x)


def _text(x) -> str:
    return "" if missing(x) else str(x)


def location(v: pd.Series) -> str:
    """A verdicts-table row's place, as `Verdict.location` reads it."""
    return Verdict(
        v["check"],
        v["scenario"],
        v["status"],
        None,
        None,
        where=_text(v.get("where")),
        step=_int_or_none(v.get("step")),
        param=_text(v.get("param")),
        rank=_int_or_none(v.get("rank")),
        sample=_int_or_none(v.get("sample")),
    ).location


def _locate(steps: pd.DataFrame, v: pd.Series) -> tuple[str, int, bool] | None:
    """(diff column, step, crossed) to anchor a failure trace at the step the verdict names; crossed
    when that step is where the check's own |param diff| column crossed its bound."""
    step = _int_or_none(v.get("step"))
    if not len(steps) or step is None or step not in set(steps["step"]):
        return None
    col = DIFF_COLUMN.get(v["check"])
    return (col, step, True) if col else ("max_diff_ref", step, False)


def _failure(v: pd.Series, tables: dict) -> list[str]:
    out = [f"### FAIL `{v['check']}` — `{v['scenario'] or 'run-wide'}`", ""]
    times = ratio(v["measured"], v["bound"], ".3g")
    out.append(
        f"- **measured** {num(v['measured'])} against **bound** {num(v['bound'])}"
        + (f" ({times} the bound, over by {num(float(v['measured']) - float(v['bound']))})" if times != "—" else "")
    )
    out += [f"- **where** (from the check): {location(v)}"] if location(v) else []
    out += [f"- {v['message']}"] if v["message"] else []
    steps = table_or_empty(tables, "steps")
    steps = steps[steps["scenario"] == v["scenario"]].sort_values("step") if len(steps) else steps
    scen = table_or_empty(tables, "scenarios")
    err = scen.loc[scen["scenario"] == v["scenario"], "error"] if len(scen) and "error" in scen else []
    if len(err) and str(err.iloc[0]) not in ("", "nan"):
        out.append(f"- **scenario error**: {err.iloc[0]}")
    anchor = _locate(steps, v)
    if anchor is None:
        return out + [
            "",
            "_No per-step trace: the check names no step and its figure is not a per-step |param diff|._",
            "",
        ]
    col, first, crossed = anchor
    row = steps[steps["step"] == first].iloc[0]
    if crossed:
        what = "the reference" if col == "max_diff_ref" else "1 rank"
        param = row["worst_param_ref" if col == "max_diff_ref" else "worst_param_ws1"]
        out.append(
            f"- **first crossing** (steps table, |param diff| vs {what}): step {first}, "
            f"`{param}`, {num(row[col])} = {ratio(row[col], v['bound'], '.3g')} the bound"
        )
    mark = "first crossing" if crossed else "where"
    window = steps[(steps["step"] >= first - 2) & (steps["step"] <= first + 2)]
    trace = pd.DataFrame(
        {
            "step": [f"{s} ← {mark}" if s == first else str(s) for s in window["step"]],
            "loss": [num(x, ".10g") for x in window["loss"]],
            "max diff vs reference": [num(x) for x in window["max_diff_ref"]],
            "worst param (ref)": window["worst_param_ref"].to_list(),
            "max diff vs 1 rank": [num(x) for x in window["max_diff_ws1"]],
            "worst param (1 rank)": window["worst_param_ws1"].to_list(),
        }
    )
    out += ["", md_table(trace), ""]
    params = table_or_empty(tables, "params")
    p = params[(params["scenario"] == v["scenario"]) & (params["step"] == first)] if len(params) else params
    if len(p):
        key = "diff_ref" if col == "max_diff_ref" else "diff_ws1"
        p = p.sort_values(key, ascending=False).head(5)
        table = pd.DataFrame(
            {
                "param": p["param"],
                "numel": p["numel"],
                "diff vs reference": [num(x) for x in p["diff_ref"]],
                "diff vs 1 rank": [num(x) for x in p["diff_ws1"]],
            }
        )
        if crossed:
            table["x bound"] = [ratio(x, v["bound"], ".3g") for x in p[key]]
        out += [f"Parameters at step {first}, largest |diff| first:", "", md_table(table), ""]
    return out


def _on(v: pd.Series) -> str:
    return f"on `{v['scenario']}`" if v["scenario"] else "(run-wide)"


def _closest_pass(check: str, g: pd.DataFrame) -> dict:
    """One row for the passes of a check: measured and bound of the same verdict, the one nearest
    its bound (largest measured / bound; the largest measured where no bound is positive)."""
    share = g["measured"] / g["bound"].where(g["bound"] > 0)
    if share.notna().any():  # a check that passes above its bound (a negative control): the smallest
        pick = share.idxmin() if (share.dropna() > 1).all() else share.idxmax()
    else:
        pick = g["measured"].idxmax() if g["measured"].notna().any() else None
    n = len(g)
    row = {
        "check": check,
        "scenario": f"{n} scenario" + "s" * (n != 1),
        "status": PASS,
        "measured": None,
        "bound": None,
        "where": "",
        "_o": 2,
    }
    if pick is not None:
        row.update(
            measured=g.at[pick, "measured"],
            bound=g.at[pick, "bound"],
            where=f"closest: {g.at[pick, 'scenario']}" if g.at[pick, "scenario"] else "",
        )
    return row


KIND_ORDER = ("correctness", "efficiency", "regression gate")


def check_kind(check: str) -> str:
    """'correctness', 'efficiency' (memory, traffic) or 'regression gate', for a check name."""
    if str(check).startswith("gate:"):
        return "regression gate"
    from harness.checks.registry import all_checks

    return {c.name: c.kind for c in all_checks()}.get(check, "correctness")


def verdict_sections(tables: dict) -> list[str]:
    verdicts = table_or_empty(tables, "verdicts")
    out = ["## Verdict summary", ""]
    if not len(verdicts):
        return out + ["_Verdicts: not measured._", ""]
    verdicts = verdicts.assign(
        _o=verdicts["status"].map(STATUS_ORDER).fillna(9),
        measured=pd.to_numeric(verdicts["measured"], errors="coerce"),
        bound=pd.to_numeric(verdicts["bound"], errors="coerce"),
    )
    verdicts = verdicts.assign(kind=verdicts["check"].map(check_kind))
    verdicts = verdicts.sort_values(["_o", "check"], kind="stable")
    rows = verdicts
    if len(verdicts) > MAX_SUMMARY_ROWS:  # passes of one check collapse into one row
        passed = pd.DataFrame(
            [_closest_pass(check, g) for check, g in verdicts[verdicts["status"] == PASS].groupby("check", sort=True)]
        )
        passed = passed.assign(kind=passed["check"].map(check_kind))
        rows = pd.concat([verdicts[verdicts["status"] != PASS], passed]).sort_values(["_o", "check"], kind="stable")
        out += [
            f"Passing verdicts are grouped per check ({len(verdicts)} verdicts in all; the run's "
            "verdicts table lists each). A grouped row shows the pass closest to its bound.",
            "",
        ]
    out += [
        "Correctness checks hold that sharded training computes what the plain model computes; "
        "efficiency checks hold memory and traffic to the ZeRO-3 ideal; the gate compares with a baseline.",
        "",
    ]
    for kind in KIND_ORDER:
        part = rows[rows["kind"] == kind]
        if not len(part):
            continue
        summary = pd.DataFrame(
            {
                "check": part["check"],
                "scenario": part["scenario"],
                "status": part["status"].str.upper(),
                "measured": [num(x) for x in part["measured"]],
                "bound": [num(x) for x in part["bound"]],
                "where": [location(v) for _, v in part.iterrows()],
            }
        )
        out += [f"### {kind.capitalize()}", "", md_table(summary), ""]
    fails = verdicts[verdicts["status"] == FAIL].fillna({"where": "", "message": ""})
    out += ["## Failures", ""] + ([] if len(fails) else ["None.", ""])
    for _, v in fails.iterrows():
        out += _failure(v, tables)
    out += ["## Known deviations", ""]
    known = verdicts[verdicts["status"] == KNOWN].fillna({"where": "", "message": ""})
    out += [
        f"- `{v['check']}` {_on(v)}: measured {num(v['measured'])} vs bound {num(v['bound'])}"
        f" ({ratio(v['measured'], v['bound'], '.3g')})"
        + (f" at {location(v)}" if location(v) else "")
        + f". **Cause:** {v['message'] or 'not stated'}"
        for _, v in known.iterrows()
    ] or ["None."]
    unsupported = verdicts[verdicts["status"] == UNSUPPORTED].fillna({"message": ""})
    if len(unsupported):
        out += [
            "",
            "## Unsupported",
            "",
            "Scenarios not run: the implementation lacks what the feature needs. Not a pass.",
            "",
        ] + [f"- `{v['scenario']}`: {v['message']}" for _, v in unsupported.iterrows()]
    skips = verdicts[verdicts["status"] == SKIP].fillna({"message": ""})
    if len(skips):
        out += ["", "Skipped checks:", ""] + [f"- `{v['check']}` {_on(v)}: {v['message']}" for _, v in skips.iterrows()]
    return out + [""]
