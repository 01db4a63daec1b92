"""The registry of checks and the one loop that runs them over a run's tables, and the verdict table."""

from __future__ import annotations

import pandas as pd

from harness.checks.common import ROW, Check
from harness.checks.features import FEATURE_CHECKS
from harness.checks.loop import LOOP_CHECKS
from harness.checks.norms import NORM_CHECKS
from harness.checks.numeric import NUMERIC_CHECKS
from harness.checks.resources import RESOURCE_CHECKS
from harness.checks.rows import ROW_CHECKS
from harness.core.policy import Bounds
from harness.core.verdict import FAIL, VERDICT_COLUMNS, Verdict


def all_checks() -> tuple[Check, ...]:
    return NUMERIC_CHECKS + ROW_CHECKS + NORM_CHECKS + LOOP_CHECKS + FEATURE_CHECKS + RESOURCE_CHECKS


def missing_columns(tables, check: Check) -> list[str]:
    out = []
    for name, cols in check.needs.items():
        df = tables.get(name)
        if not isinstance(df, pd.DataFrame):
            out.append(f"table '{name}'")
        else:
            out += [f"column '{name}.{c}'" for c in cols if c not in df.columns]
    return out


def run_checks(tables, bounds: Bounds = Bounds(), extra: tuple[Check, ...] = ()) -> list[Verdict]:
    """Every check over the tables. A check that cannot run, or that stays silent about a scenario
    it applies to, gives FAIL verdicts that say so: a PASS always means a property was measured."""
    sc = tables.get("scenarios")
    if not isinstance(sc, pd.DataFrame) or any(c not in sc.columns for c in ROW):
        return [
            Verdict(
                "run",
                "",
                FAIL,
                None,
                None,
                message="could not check anything: the scenarios table or its id columns are missing",
            )
        ]
    verdicts = []
    for check in all_checks() + tuple(extra):
        applicable = [r for r in sc.itertuples() if check.applies(r)]
        missing = missing_columns(tables, check)
        if missing:
            verdicts += [
                Verdict(
                    check.name,
                    r.scenario,
                    FAIL,
                    None,
                    None,
                    message=(f"could not be checked: {', '.join(missing)} missing from the run's tables"),
                )
                for r in applicable
            ]
            continue
        try:
            got = check.fn(tables, bounds)
        except Exception as e:  # a check that breaks fails what it applies to; the other checks still run
            got = [
                Verdict(
                    check.name,
                    r.scenario,
                    FAIL,
                    None,
                    None,
                    message=f"could not be checked: the check raised {type(e).__name__}: {e}",
                )
                for r in applicable
            ]
        verdicts += got
        spoken = {v.scenario for v in got}
        verdicts += [
            Verdict(
                check.name,
                r.scenario,
                FAIL,
                None,
                None,
                message=("could not be checked: the check gave no verdict for a scenario it applies to"),
            )
            for r in applicable
            if r.scenario not in spoken
        ]
    return verdicts


def verdict_table(verdicts: list[Verdict]) -> pd.DataFrame:
    """One row per verdict; step, rank and sample as floats (NaN where not given) for a stable CSV."""
    df = pd.DataFrame([v.as_dict() for v in verdicts], columns=VERDICT_COLUMNS)
    for c in ("step", "rank", "sample"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    return df
