"""Pure checks over the run's tables. Each returns Verdicts; pytest, the report and the gate read them."""

from __future__ import annotations

import math

import pandas as pd

from .policy import Bounds, known_deviation
from .scenario import REFERENCE_IMPL, Scenario
from .verdict import FAIL, KNOWN, PASS, SKIP, Verdict


def _fmt(x: float) -> str:
    return "nan" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"


def _first_crossing(steps: pd.DataFrame, sid: str, col: str, bound: float, strict_zero: bool = False) -> tuple[str, float]:
    """(where, worst) for one scenario: the first step and parameter where `col` crossed the bound."""
    rows = steps[steps.scenario == sid].sort_values("step")
    worst = float(rows[col].max()) if len(rows) else math.nan
    if rows[col].isna().any():
        worst = math.nan
    param_col = "worst_param_ref" if col.endswith("ref") else "worst_param_ws1"
    for _, r in rows.iterrows():
        v = r[col]
        crossed = (v != 0) if strict_zero else (v >= bound)
        if math.isnan(v) or crossed:
            return f"step {int(r.step)}, {r[param_col]} ({_fmt(v)})", worst
    return "", worst


def _reference_id(row) -> str:
    """The id of the non-sharded run a scenarios-table row is compared with."""
    return Scenario(row.impl, row.model, 1, row.data_mode, row.optimizer, seed=int(row.seed)).reference().id


def _verdict(check, row, passed, measured, bound, where, message) -> Verdict:
    if passed:
        return Verdict(check, row.scenario, PASS, measured, bound, "", message)
    dev = known_deviation(row.impl, check, int(row.world_size))
    if dev is not None:
        return Verdict(check, row.scenario, KNOWN, measured, bound, where, f"{message} Known deviation: {dev.cause}.")
    return Verdict(check, row.scenario, FAIL, measured, bound, where, message)


def ws1_exact(tables) -> list[Verdict]:
    """World size 1 vs the plain model: bitwise equal losses and parameters at every step."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    ref_losses = {s: g.sort_values("step").loss.tolist() for s, g in steps.groupby("scenario")}
    for row in sc[(sc.world_size == 1) & (sc.impl != REFERENCE_IMPL) & (sc.status == "ok")].itertuples():
        ref_id = _reference_id(row)
        losses, ref = ref_losses.get(row.scenario, []), ref_losses.get(ref_id)
        if ref is None:
            out.append(Verdict("ws1_exact", row.scenario, SKIP, None, 0.0, "", "no reference run in this matrix"))
            continue
        where, worst = _first_crossing(steps, row.scenario, "max_diff_ref", 0.0, strict_zero=True)
        bad_loss = next((i + 1 for i, (a, b) in enumerate(zip(losses, ref)) if a != b), None)
        if bad_loss is not None and not where:
            where = f"step {bad_loss}, loss ({losses[bad_loss - 1]!r} vs {ref[bad_loss - 1]!r})"
        passed = not where and len(losses) == len(ref)
        msg = ("losses and parameters bitwise equal to the non-sharded model at every step" if passed else
               f"world size 1 differs from the non-sharded model: max |param diff| {_fmt(worst)}")
        out.append(_verdict("ws1_exact", row, passed, worst, 0.0, where, msg))
    return out


def cross_ws_replicated(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Replicated data: parameters at world size W stay within the bound of world size 1, every step."""
    out, bound = [], bounds.cross_ws_replicated
    sc, steps = tables["scenarios"], tables["steps"]
    for row in sc[(sc.world_size > 1) & (sc.data_mode == "replicated") & (sc.status == "ok")].itertuples():
        where, worst = _first_crossing(steps, row.scenario, "max_diff_ws1", bound)
        if math.isnan(worst) and not where:
            out.append(Verdict("cross_ws_replicated", row.scenario, SKIP, None, bound, "", "no world-size-1 run to compare with"))
            continue
        passed = not where
        msg = f"max |param diff| vs world size 1 = {_fmt(worst)} (bound < {bound:g})"
        out.append(_verdict("cross_ws_replicated", row, passed, worst, bound, where, msg))
    return out


def split_matches_full_batch(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Split data: each rank's 1/W slice, averaged, trains like the full batch within the stated bound."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    for row in sc[(sc.world_size > 1) & (sc.data_mode == "split") & (sc.status == "ok")].itertuples():
        bound = bounds.split_bound(row.optimizer, row.lr, int(row.steps))
        where, worst = _first_crossing(steps, row.scenario, "max_diff_ref", bound)
        passed = not where and not math.isnan(worst)
        msg = (f"max |param diff| vs full-batch training = {_fmt(worst)} "
               f"(bound {bound:.3g} = {bound / (row.lr * row.steps):g} x lr x steps)")
        out.append(_verdict("split_matches_full_batch", row, passed, worst, bound, where, msg))
    return out


def grad_norm_matches(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Step 1's global gradient norm equals the non-sharded model's within a relative bound.

    At step 1 every implementation starts from the same parameters and sees the same global batch,
    so its averaged gradient differs from the plain model's by rounding only (measured <= 9e-9
    relative over the default matrix). Parameters alone miss gradient faults that no optimizer step
    shows, such as junk in the padding of a flat shard; the norm reads the whole local gradient."""
    out, bound = [], bounds.grad_norm_rel
    sc, steps = tables["scenarios"], tables["steps"]
    first = {r.scenario: r.grad_norm for r in steps[steps.step == steps.step.min()].itertuples()} if len(steps) else {}
    for row in sc[(sc.impl != REFERENCE_IMPL) & (sc.status == "ok")].itertuples():
        ref_id = _reference_id(row)
        got, ref = first.get(row.scenario, math.nan), first.get(ref_id, math.nan)
        if math.isnan(ref) or ref == 0 or (math.isnan(got) and row.scenario not in first):
            out.append(Verdict("grad_norm_matches", row.scenario, SKIP, None, bound, "",
                               "no reference gradient norm in this matrix"))
            continue
        rel = abs(got - ref) / abs(ref) if math.isfinite(got) else math.inf
        passed = rel <= bound
        msg = f"step-1 gradient norm {got:.9g} vs non-sharded {ref:.9g}: relative difference {_fmt(rel)} (bound {bound:g})"
        out.append(_verdict("grad_norm_matches", row, passed, rel, bound, "" if passed else "step 1, gradient norm", msg))
    return out


def converges(tables) -> list[Verdict]:
    """The loss falls: last step's loss below the first step's."""
    out = []
    steps = tables["steps"]
    for row in tables["scenarios"][tables["scenarios"].status == "ok"].itertuples():
        s = steps[steps.scenario == row.scenario].sort_values("step")
        first, last = float(s.loss.iloc[0]), float(s.loss.iloc[-1])
        passed = last < first
        msg = f"loss {first:.6g} -> {last:.6g}"
        out.append(_verdict("converges", row, passed, last - first, 0.0, "" if passed else f"step {int(s.step.iloc[-1])}", msg))
    return out


def finite(tables) -> list[Verdict]:
    """No NaN or Inf in any loss or parameter: a NaN must never pass a diff comparison."""
    out = []
    steps, params = tables["steps"], tables["params"]
    for row in tables["scenarios"][tables["scenarios"].status == "ok"].itertuples():
        s = steps[steps.scenario == row.scenario].sort_values("step")
        p = params[params.scenario == row.scenario].sort_values(["step", "param"])
        bad_loss = s[~s.loss.map(math.isfinite)]
        bad_param = p[~p["sum"].map(math.isfinite)]
        where = ""
        if len(bad_param):
            where = f"step {int(bad_param.step.iloc[0])}, {bad_param.param.iloc[0]}"
        if len(bad_loss):
            where = f"step {int(bad_loss.step.iloc[0])}, loss"
        passed = not where
        msg = "all losses and parameters finite" if passed else "non-finite loss or parameter"
        out.append(_verdict("finite", row, passed, None, None, where, msg))
    return out


def errors(tables) -> list[Verdict]:
    """A scenario that did not complete (a rank raised or hung) is a failure with its message."""
    sc = tables["scenarios"]
    return [Verdict("completed", row.scenario, FAIL, None, None, "", str(row.error))
            for row in sc[sc.status != "ok"].itertuples()]


NUMERIC_CHECKS = (errors, finite, ws1_exact, cross_ws_replicated, split_matches_full_batch, grad_norm_matches,
                  converges)


def run_checks(tables, bounds: Bounds = Bounds(), extra=()) -> list[Verdict]:
    from .resource_checks import RESOURCE_CHECKS
    verdicts = []
    for check in NUMERIC_CHECKS + RESOURCE_CHECKS + tuple(extra):
        try:
            verdicts.extend(check(tables, bounds) if "bounds" in check.__code__.co_varnames else check(tables))
        except KeyError as e:  # a table this check needs is absent: say so, never pass silently
            verdicts.append(Verdict(check.__name__, "", SKIP, None, None, "", f"table or column missing: {e}"))
    return verdicts


def verdict_table(verdicts: list[Verdict]) -> pd.DataFrame:
    return pd.DataFrame([v.as_dict() for v in verdicts],
                        columns=["check", "scenario", "status", "measured", "bound", "where", "message"])
