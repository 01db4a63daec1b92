"""What the checks share: the Check record and the predicates that say which scenarios a check applies to, the
verdict a failed comparison becomes (`judge`: PASS, KNOWN for a documented deviation, else FAIL), and the small
readers of the tables (first crossing of a bound, rows per scenario)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from harness.core.policy import Bounds, known_deviation
from harness.core.scenario import REFERENCE_IMPL, Scenario, backend_of, feature_of, widest
from harness.core.verdict import FAIL, KNOWN, PASS, Verdict

# the scenarios table's columns every check reads (feature: optional)
ROW = ("scenario", "impl", "model", "world_size", "data_mode", "optimizer", "seed", "status")
EMPTY = pd.DataFrame(columns=["step", "param", "loss", "sum"])


@dataclass(frozen=True)
class Check:
    """A named check, the scenarios it applies to, and the tables and columns it reads.

    `run_checks` (checks.registry) holds every check to its `applies`: each applicable scenario gets at least one
    verdict (a missing one is a FAIL), and a missing table or column is a FAIL per scenario that names it, never a
    silent pass."""

    fn: Callable[[dict, Bounds], list[Verdict]]
    applies: Callable[[object], bool]
    needs: dict[str, tuple[str, ...]]
    kind: str = "correctness"  # "correctness" (the training is the same) or "efficiency" (memory, traffic)

    @property
    def name(self) -> str:
        return self.fn.__name__


# Which scenarios a check applies to #


def all_rows(row) -> bool:
    return True


def ok_row(row) -> bool:
    return row.status == "ok"


def sharded_ws1(row) -> bool:
    return ok_row(row) and widest(row) == 1 and row.impl != REFERENCE_IMPL


def multi_rank(mode: str):
    return lambda r: ok_row(r) and widest(r) > 1 and r.data_mode == mode


def not_reference(row) -> bool:
    return ok_row(row) and row.impl != REFERENCE_IMPL


# Verdicts #


def fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


@dataclass(frozen=True)
class Crossing:
    """The first step and parameter where a per-step |param diff| crossed its bound (or went NaN)."""

    step: int
    param: str
    value: float


def first_crossing(
    steps: pd.DataFrame, sid: str, col: str, bound: float, strict_zero: bool = False
) -> tuple[Crossing | None, float]:
    """(first crossing or None, worst value) for one scenario's `col` of the steps table."""
    rows = steps[steps.scenario == sid].sort_values("step")
    worst = float(rows[col].max()) if len(rows) else math.nan
    if rows[col].isna().any():
        worst = math.nan
    param_col = col.replace("max_diff", "worst_param")
    for _, r in rows.iterrows():
        v = r[col]
        crossed = (v != 0) if strict_zero else (v >= bound)
        if math.isnan(v) or crossed:
            return Crossing(int(r.step), str(r[param_col]), float(v)), worst
    return None, worst


def reference_id(row) -> str:
    """The id of the non-sharded run a scenarios-table row is compared with."""
    return Scenario.of_row(row).reference().id


def judge(
    check,
    row,
    passed,
    measured,
    bound,
    message,
    *,
    at: Crossing | None = None,
    step: int | None = None,
    param: str = "",
    where: str = "",
    rank: int | None = None,
) -> Verdict:
    """PASS, else KNOWN for a documented deviation (harness/core/policy.py), else FAIL; `at` locates it."""
    if at is not None:
        step, param, where = at.step, at.param, where or fmt(at.value)
    if passed:
        return Verdict(check, row.scenario, PASS, measured, bound, message=message, rank=rank)
    loc = dict(where=where, step=step, param=param, rank=rank)
    dev = known_deviation(row.impl, check, widest(row), feature_of(row), message, backend_of(row))
    if dev is not None:
        return Verdict(
            check,
            row.scenario,
            KNOWN,
            measured,
            bound,
            message=f"{message} Known deviation: {dev.cause_for(row.optimizer)}.",
            **loc,
        )
    return Verdict(check, row.scenario, FAIL, measured, bound, message=message, **loc)


def by_scenario(table: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """A table's rows per scenario, split once (a check that filters the whole table for each scenario is
    quadratic in the run's size: reports/performance.md#snapshots-tables-and-checks)."""
    return dict(tuple(table.groupby("scenario", sort=False))) if len(table) else {}


def not_measured(check: str, row, what: str, bound: float | None = None) -> Verdict:
    """A check that applies but could not run: a FAIL that says what was missing."""
    return Verdict(check, row.scenario, FAIL, None, bound, message=f"could not be checked: {what}")


def ok_rows(sc: pd.DataFrame) -> pd.DataFrame:
    return sc[sc.status == "ok"]


def first_param_crossing(
    rows: pd.DataFrame | None, col: str, held: dict[str, float], bound: float, sensitive_params: set[str]
) -> tuple[Crossing | None, float]:
    """(first crossing or None, worst `col` of the parameters held to the tier's bound) for one scenario's
    params-table rows: the first step where a parameter's `col` reaches the bound it is held to (or is NaN),
    naming the parameter furthest over at that step."""
    if rows is None or not len(rows) or col not in rows:
        return None, math.nan
    diff = rows[col]
    limit = rows.param.map(lambda p: held.get(p, bound))
    healthy = diff[~rows.param.isin(sensitive_params)]
    worst = math.nan if diff.isna().any() else float(healthy.max()) if len(healthy) else 0.0
    over = rows[diff.isna() | (diff >= limit)]
    if not len(over):
        return None, worst
    first = over[over.step == over.step.min()]
    hit = first.loc[(first[col] / limit[first.index]).fillna(math.inf).idxmax()]
    return Crossing(int(hit.step), str(hit.param), float(hit[col])), worst


def rank_or_none(x) -> int | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) or x == "" else int(x)
