"""Pure checks over the run's tables. Each returns Verdicts; pytest, the report and the gate read them."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from harness.checks.common import (
    EMPTY,
    ROW,
    Check,
    Crossing,
    all_rows,
    by_scenario,
    first_crossing,
    first_param_crossing,
    fmt,
    judge,
    multi_rank,
    not_measured,
    not_reference,
    ok_row,
    ok_rows,
    rank_or_none,
    reference_id,
    sharded_ws1,
)
from harness.checks.noise_floor import (
    batch_stats_of,
    holding,
    probe_cause,
    probe_maxima,
    resumed_across_sizes,
    split_yardstick,
)
from harness.core.features import rounded_per_rank
from harness.core.policy import BF16_SPLIT, Bounds, not_exact
from harness.core.scenario import REFERENCE_IMPL, Scenario, feature_of, resume_of, widest
from harness.core.verdict import PASS, SKIP, UNSUPPORTED, Verdict


def ranks_off(tables, sid: str, at: Crossing | None, col: str, bound: float) -> tuple[int | None, str]:
    """At a crossing, which ranks hold the rows of its parameter that crossed `bound` (the rank_diffs table,
    where the implementation lays parameters out by rows): (that rank where it is one rank among several,
    else None; a phrase for the message, '' where the table says nothing)."""
    rd = tables.get("rank_diffs")
    if at is None or not isinstance(rd, pd.DataFrame) or not len(rd) or col not in rd:
        return None, ""
    mine = rd[(rd.scenario == sid) & (rd.step == at.step) & (rd.param == at.param)]
    if len(mine) < 2:
        return None, ""
    off = sorted(int(r) for r in mine[mine[col].isna() | (mine[col] >= bound)]["rank"])
    if not off or len(off) == len(mine):
        return None, f"; every rank's rows of {at.param} crossed it" if off else ""
    held = sorted(set(int(r) for r in mine["rank"]) - set(off))
    who = f"rank {off[0]}" if len(off) == 1 else "ranks " + ", ".join(map(str, off))
    return (off[0] if len(off) == 1 else None), (
        f"; only {who}'s rows of {at.param} crossed it (ranks {', '.join(map(str, held))} within the bound)"
    )


def reduction_hint(steps: pd.DataFrame, sid: str, upto: int | None) -> tuple[int | None, str]:
    """Replicated data: where some rank put another gradient into a reduction than the others at or before
    step `upto` (steps.reduction_ranks): (that rank where it is one, else None; a phrase for the message)."""
    if "reduction_ranks" not in steps or not len(steps):
        return None, ""
    mine = steps[(steps.scenario == sid) & steps.reduction_ranks.map(lambda r: isinstance(r, str) and r != "")]
    if upto is not None:
        mine = mine[mine.step <= upto]
    if not len(mine):
        return None, ""
    first = mine.sort_values("step").iloc[0]
    ranks = [int(r) for r in str(first.reduction_ranks).split(",")]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return (ranks[0] if len(ranks) == 1 else None), (
        f"; at step {int(first.step)} {who} put a different gradient into the reduction than the other ranks (with "
        "replicated data every rank computes the same one: the fault is before the reduction, on that rank)"
        if len(ranks) == 1
        else f"; at step {int(first.step)} the ranks put different gradients into the reduction "
        f"({who}; with replicated data every rank computes the same one: the fault is before the reduction)"
    )


def _trajectories(steps: pd.DataFrame) -> dict[str, list[float]]:
    return {s: g.sort_values("step").loss.tolist() for s, g in steps.groupby("scenario")}


def ws1_exact(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """World size 1 vs the plain model: bitwise equal losses and parameters at every step."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    losses_of = _trajectories(steps)
    for row in ok_rows(sc)[lambda d: (_widest(d) == 1) & (d.impl != REFERENCE_IMPL)].itertuples():
        ref_id = reference_id(row)
        losses, ref = losses_of.get(row.scenario, []), losses_of.get(ref_id)
        if ref is None:
            out.append(not_measured("ws1_exact", row, f"the reference run {ref_id} did not complete", 0.0))
            continue
        at, worst = first_crossing(steps, row.scenario, "max_diff_ref", 0.0, strict_zero=True)
        bad_loss = next((i + 1 for i, (a, b) in enumerate(zip(losses, ref)) if a != b), None)
        loss_step = None
        if bad_loss is not None and (at is None or bad_loss < at.step):
            at, loss_step = None, bad_loss
        passed = at is None and loss_step is None and len(losses) == len(ref)
        msg = (
            "losses and parameters bitwise equal to the non-sharded model at every step"
            if passed
            else f"world size 1 differs from the non-sharded model: max |param diff| {fmt(worst)}"
        )
        if loss_step is not None:
            msg += f"; loss {losses[loss_step - 1]!r} vs {ref[loss_step - 1]!r} at step {loss_step}"
        out.append(
            judge(
                "ws1_exact",
                row,
                passed,
                worst,
                0.0,
                msg,
                at=at,
                step=loss_step,
                param="loss" if loss_step is not None else "",
            )
        )
    return out


def cross_ws_replicated(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Replicated data: parameters at world size W stay within the bound of world size 1, every step.
    Under a feature no correct implementation is bitwise under (NOT_EXACT: L2 clipping) the bound is the
    split tier's, parameter by parameter, and a parameter the nudged noise probe finds model-sensitive is
    held to its floor or AdamW's reach (harness/core/policy.py [Note: noise floor])."""
    out = []
    sc, steps, params = tables["scenarios"], tables["steps"], tables["params"]
    done = set(ok_rows(sc).scenario)
    maxima = probe_maxima(tables)
    params_of = by_scenario(params)
    for row in ok_rows(sc)[lambda d: (_widest(d) > 1) & (d.data_mode == "replicated")].itertuples():
        ws1 = _ws1_id(row)
        bound, why = bounds.replicated_bound(feature_of(row), row.optimizer, row.lr, int(row.steps))
        probes = Scenario.of_row(row).noise_probes()
        lost = [i for i in (ws1, *(p.id for p in probes)) if i not in done]
        if lost:
            what = "the world-size-1 run" if lost[0] == ws1 else "the noise probe"
            out.append(not_measured("cross_ws_replicated", row, f"{what} {lost[0]} did not complete", bound))
            continue
        note = ""
        if probes:
            hold = holding(row, maxima, probes, False, bounds)
            mine = params_of.get(row.scenario, params.iloc[:0])
            at, worst = first_param_crossing(mine, "diff_ws1", hold.held, bound, set(hold.hot))
            bound_at = hold.held.get(at.param, bound) if at else bound
            note = hold.note(mine.groupby("param").diff_ws1.max()) if hold.hot else ""
        else:
            at, worst = first_crossing(steps, row.scenario, "max_diff_ws1", bound)
            bound_at = bound
        rank, whose = ranks_off(tables, row.scenario, at, "diff_ws1", bound_at)
        if at is not None:
            sender, sent = reduction_hint(steps, row.scenario, at.step)
            rank, whose = (rank if rank is not None else sender), whose + sent
        msg = (
            f"max |param diff| vs world size 1 = {fmt(worst)} (bound < {bound:g}{'; ' + why if why else ''})"
            f"{note}{whose}"
        )
        passed = at is None and not (probes and math.isnan(worst))
        out.append(judge("cross_ws_replicated", row, passed, worst, bound, msg, at=at, rank=rank))
    return out


def grads_match_ws1(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Replicated data: the gradient values the optimizers apply at world size W, over all ranks,
    are bitwise those at world size 1, at every step (sorted, so no layout matters). Every rank
    computes the same local gradient, so an exact reduction reproduces it; a one-ulp reduction
    error shows here at step 1, before an optimizer amplifies it or rounds it away."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    done = set(ok_rows(sc).scenario)
    for row in ok_rows(sc)[lambda d: (_widest(d) > 1) & (d.data_mode == "replicated")].itertuples():
        if not_exact(feature_of(row), row.optimizer):
            out.append(
                Verdict(
                    "grads_match_ws1",
                    row.scenario,
                    SKIP,
                    None,
                    None,
                    message=f"does not apply: {not_exact(feature_of(row), row.optimizer)}",
                )
            )
            continue
        ws1 = _ws1_id(row)
        mine = steps[steps.scenario == row.scenario].sort_values("step")
        if ws1 not in done or not len(mine) or mine.grad_diff_ws1.isna().all():
            out.append(not_measured("grads_match_ws1", row, f"no gradient values recorded for it and for {ws1}", 0.0))
            continue
        bad = mine[mine.grad_diff_ws1.isna() | (mine.grad_diff_ws1 != 0)]
        worst = float(mine.grad_diff_ws1.max())
        if not len(bad):
            out.append(
                judge(
                    "grads_match_ws1",
                    row,
                    True,
                    0.0,
                    0.0,
                    "gradient values bitwise those at world size 1 at every step",
                )
            )
            continue
        first = bad.iloc[0]
        what = (
            "missing"
            if math.isnan(first.grad_diff_ws1)
            else "a different number of non-zero values"
            if math.isinf(first.grad_diff_ws1)
            else f"max |sorted diff| {fmt(first.grad_diff_ws1)}"
        )
        sender, sent = reduction_hint(steps, row.scenario, int(first.step))
        out.append(
            judge(
                "grads_match_ws1",
                row,
                False,
                worst,
                0.0,
                f"the gradient the optimizers applied differs from world size 1 from step "
                f"{int(first.step)}: {what}{sent}",
                step=int(first.step),
                param="gradient values",
                where=what,
                rank=sender,
            )
        )
    return out


def split_matches_full_batch(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Split data: each rank's 1/W slice, averaged, trains like the full batch within the stated bound,
    parameter by parameter; a parameter whose own noise floor is higher is held to that
    (harness/core/policy.py [Note: noise floor]). A model with batch statistics, or a loss weighted by a count
    each sample carries, is held to its noise probe in rank order, the equivalent computation (probe_cause)."""
    out = []
    sc, params = tables["scenarios"], tables["params"]
    done = set(ok_rows(sc).scenario)
    params_of = by_scenario(params)
    maxima = probe_maxima(tables)
    for row in ok_rows(sc)[lambda d: (_widest(d) > 1) & (d.data_mode == "split")].itertuples():
        bound = bounds.split_bound(row.optimizer, row.lr, int(row.steps))
        why = f"{bound / (row.lr * row.steps):g} x lr x steps"
        scen = Scenario.of_row(row)
        probes = scen.noise_probes()
        lost = [p.id for p in probes if p.id not in done]
        if lost:
            out.append(
                not_measured("split_matches_full_batch", row, f"the noise probe {lost[0]} did not complete", bound)
            )
            continue
        layers, cause, col = batch_stats_of(row), probe_cause(row), "diff_ref"
        rounded = rounded_per_rank(feature_of(row))  # its reference is the ranks' micro-batches already
        against = "full-batch training"
        if rounded and resumed_across_sizes(row):
            out.append(
                Verdict(
                    "split_matches_full_batch",
                    row.scenario,
                    SKIP,
                    None,
                    bound,
                    message=(
                        f"does not apply: {BF16_SPLIT}; a run resumed at another world size rounded its first steps' "
                        f"gradients over {resume_of(row)} ranks and the rest over {int(row.world_size)}, which no single "
                        "plain run reproduces (its restore is held by ckpt_restored, its step-1 norm and its loss by its "
                        "saver's yardstick)"
                    ),
                )
            )
            continue
        if cause and not rounded:
            if resumed_across_sizes(row):
                out.append(
                    Verdict(
                        "split_matches_full_batch",
                        row.scenario,
                        SKIP,
                        None,
                        bound,
                        message=(
                            f"does not apply: {cause}; a run resumed at another world "
                            "size trained on two different cuts of the batch, which no single plain run reproduces"
                        ),
                    )
                )
                continue
            col, against = "diff_probe", "the plain model on the ranks' micro-batches"
            why += f"; {cause}"
        elif rounded:
            against = f"full-batch training in {scen.reference().micro_batches} micro-batches"
            why += f"; {BF16_SPLIT}"
        hold = holding(row, maxima, probes, bool(cause) or rounded, bounds)
        rows = params_of.get(row.scenario)
        if layers and not rounded and int(row.world_size) > 2 and rows is not None and len(rows):
            rows, why = _first_step_only(rows, params_of, probes, why)
        at, worst = first_param_crossing(rows, col, hold.held, bound, set(hold.hot))
        msg = f"max |param diff| vs {against} = {fmt(worst)} (bound {bound:.3g} = {why})"
        if hold.hot:
            msg += hold.note(rows.groupby("param")[col].max())
        rank, whose = ranks_off(tables, row.scenario, at, col, hold.held.get(at.param, bound) if at else bound)
        out.append(
            judge(
                "split_matches_full_batch",
                row,
                at is None and not math.isnan(worst),
                worst,
                bound,
                msg + whose,
                at=at,
                rank=rank,
            )
        )
    return out


def _first_step_only(rows: pd.DataFrame, params_of: dict, probes, why: str) -> tuple[pd.DataFrame, str]:
    """A model with batch statistics at W > 2 ranks: only the first step is held. Beyond it two correct
    orders of summation of the same slice gradients part by more than rounding, since each rank's batch
    statistics amplify the difference step by step ([Note: noise floor], BATCH_STATS_SPLIT); the reversed
    probe's parting from the rank-order one is shown as the evidence."""
    first = int(rows.step.min())
    rev = pd.concat(
        [params_of[p.id] for p in probes if p.reverse_micro and p.id in params_of]
        or [pd.DataFrame(columns=["step", "diff_probe"])]
    )
    spread = rev.groupby("step").diff_probe.max() if len(rev) else pd.Series(dtype=float)
    parted = (
        (
            f": the plain model's two orders of summation part by {fmt(float(spread.get(first, math.nan)))} at "
            f"step {first} and {fmt(float(spread.max()))} by step {int(spread.index.max())}"
        )
        if len(spread)
        else ""
    )
    return rows[rows.step == first], (
        f"{why}; held at step {first} only, where both start from the same parameters "
        f"and only the order of summation differs; later steps are not held{parted}"
    )


def converges(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """The loss falls over the run wherever the plain model's own loss falls on the same data.

    Whether a few steps lower the loss depends on the seed, the optimizer and the learning rate,
    not on sharding: on some seeds the plain model's loss rises too. So the yardstick is the
    reference's own trajectory: where it falls, the sharded run's must fall as well (last step's
    loss below the first's); where it does not, the check does not apply and says so."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    losses_of = _trajectories(steps)
    for row in ok_rows(sc)[lambda d: d.impl != REFERENCE_IMPL].itertuples():
        if row.data_mode == "split" and probe_cause(row) and resumed_across_sizes(row):
            out.append(
                Verdict(
                    "converges",
                    row.scenario,
                    SKIP,
                    None,
                    0.0,
                    message=(
                        f"does not apply: {probe_cause(row)}; a run resumed at another "
                        "world size normalised two different cuts of the batch, whose loss no single plain run traces"
                    ),
                )
            )
            continue
        ref_id, losses = split_yardstick(row), losses_of.get(row.scenario, [])
        ref = losses_of.get(ref_id)
        if ref is None or not losses:
            out.append(
                not_measured("converges", row, f"no loss trajectory of {ref_id if ref is None else row.scenario}")
            )
            continue
        if not ref[-1] < ref[0]:
            out.append(
                Verdict(
                    "converges",
                    row.scenario,
                    SKIP,
                    None,
                    0.0,
                    message=(
                        f"does not apply: the non-sharded model's own loss does not fall on this seed "
                        f"({ref[0]:.6g} -> {ref[-1]:.6g} over {len(ref)} steps)"
                    ),
                )
            )
            continue
        first, last = losses[0], losses[-1]
        msg = f"loss {first:.6g} -> {last:.6g} (non-sharded {ref[0]:.6g} -> {ref[-1]:.6g})"
        out.append(judge("converges", row, last < first, last - first, 0.0, msg, step=len(losses), param="loss"))
    return out


def finite(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """No NaN or Inf in any loss or parameter: a NaN must never pass a diff comparison. A failure names the
    first step with a non-finite loss or parameter, and for a loss the module whose forward output was first
    non-finite in the `param` field (the steps table's nonfinite_module, harness/train/nonfinite.py: a module
    path, '(model)', or 'loss' where the forward was finite and the loss was not)."""
    out = []
    steps, params = tables["steps"], tables["params"]
    recorded = set(steps.scenario) & set(params.scenario)
    # the non-finite rows of the whole run, split per scenario: most scenarios have none to sort
    bad_losses = by_scenario(steps[~np.isfinite(steps.loss.to_numpy(dtype=float))])
    bad_params = by_scenario(params[~np.isfinite(params["sum"].to_numpy(dtype=float))])
    for row in ok_rows(tables["scenarios"]).itertuples():
        if row.scenario not in recorded:
            out.append(not_measured("finite", row, "no losses or no parameters were recorded"))
            continue
        bad_loss = bad_losses[row.scenario].sort_values("step") if row.scenario in bad_losses else EMPTY
        bad_param = bad_params[row.scenario].sort_values(["step", "param"]) if row.scenario in bad_params else EMPTY
        step, param, msg = None, "", "all losses and parameters finite"
        if len(bad_param):
            step, param = int(bad_param.step.iloc[0]), str(bad_param.param.iloc[0])
            msg = f"parameter {param} is not finite after step {step} (the loss of every step before it was finite)"
        if len(bad_loss) and (step is None or int(bad_loss.step.iloc[0]) <= step):
            first = bad_loss.iloc[0]
            step, value = int(first.step), float(first.loss)
            param, msg = _nonfinite_source(str(first.get("nonfinite_module", "") or ""), step, value)
        out.append(judge("finite", row, step is None, None, None, msg, step=step, param=param))
    return out


def _nonfinite_source(module: str, step: int, value: float) -> tuple[str, str]:
    """(the verdict's `param`, its message) for a loss of `value` at `step`, first non-finite there, whose
    source the rank found to be `module` (harness/train/nonfinite.py; '' or missing: not looked for)."""
    from harness.train.nonfinite import LOSS, NOT_REPRODUCED, ROOT

    head = f"the loss of step {step} is {value}"
    if module == LOSS:
        return "loss", f"{head}: every module's output was finite, loss(outputs, targets) was not"
    if module == NOT_REPRODUCED:
        return "loss", (
            f"{head}, while the plain model at the run's parameters before that step gives a finite loss on the "
            "same batch: the non-finite value came from the implementation's step"
        )
    if module == ROOT:
        return ROOT, f"{head}: the model's own forward (no submodule) first output a non-finite value"
    if module:
        return module, f"{head}: module {module} was the first whose forward output was non-finite"
    return "loss", f"{head} (where it first appeared was not recorded)"


def params_cover_model(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """`full_params` gives every parameter of the plain model, under its name, with its shape, at
    every step: a parameter left out would never be compared, so a bug confined to it would pass."""
    out = []
    sc, cover = tables["scenarios"], tables["coverage"]
    for row in ok_rows(sc)[lambda d: d.impl != REFERENCE_IMPL].itertuples():
        n = row.params_compared
        if pd.isna(n):
            out.append(
                not_measured(
                    "params_cover_model", row, f"no parameters of {reference_id(row)} to hold full_params against"
                )
            )
            continue
        bad = cover[cover.scenario == row.scenario].sort_values("step", kind="stable")  # missing first
        if not len(bad):
            out.append(
                Verdict(
                    "params_cover_model",
                    row.scenario,
                    PASS,
                    0,
                    0,
                    message=(
                        f"full_params gave all {int(n)} parameters of the plain model, names and shapes, at every step"
                    ),
                )
            )
            continue
        first = bad.iloc[0]
        at_first = bad[bad.step == first.step]
        listed = "; ".join(f"{r.param}: {r.problem}" for r in at_first.head(5).itertuples())
        more = f" (and {len(at_first) - 5} more)" if len(at_first) > 5 else ""
        out.append(
            judge(
                "params_cover_model",
                row,
                False,
                len(at_first),
                0,
                f"full_params disagrees with the plain model's {int(n)} parameters at step "
                f"{int(first.step)}: {listed}{more}",
                step=int(first.step),
                param=str(first.param),
                where=str(first.problem),
            )
        )
    return out


def completed(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Every rank finished; a scenario that raised or hung is a failure with its message (KNOWN where
    policy documents that very error), one whose implementation cannot do its feature is
    `unsupported` (not run, not passed)."""
    out = []
    for row in tables["scenarios"].itertuples():
        rank = rank_or_none(getattr(row, "failed_rank", None))
        if row.status in ("ok", "unsupported"):
            out.append(
                Verdict(
                    "completed",
                    row.scenario,
                    PASS if row.status == "ok" else UNSUPPORTED,
                    None,
                    None,
                    message="every rank finished" if row.status == "ok" else str(row.error),
                    rank=rank,
                )
            )
        else:
            out.append(judge("completed", row, False, None, None, str(row.error), rank=rank))
    return out


def _widest(d: pd.DataFrame) -> pd.Series:
    """`scenario.widest` of each row: a resumed run is held to the bounds of the world sizes it trained at."""
    return d.apply(widest, axis=1) if len(d) else d.world_size


def _ws1_id(row) -> str:
    return Scenario.of_row(row).ws1().id


_STEPS = ("scenario", "step", "loss")
_DIFFS = _STEPS + ("max_diff_ref", "worst_param_ref", "max_diff_ws1", "worst_param_ws1")

NUMERIC_CHECKS = (
    Check(completed, all_rows, {"scenarios": ROW + ("error",)}),
    Check(finite, ok_row, {"scenarios": ROW, "steps": _STEPS, "params": ("scenario", "step", "param", "sum")}),
    Check(ws1_exact, sharded_ws1, {"scenarios": ROW, "steps": _DIFFS}),
    Check(
        cross_ws_replicated,
        multi_rank("replicated"),
        {"scenarios": ROW + ("steps", "lr"), "steps": _DIFFS, "params": ("scenario", "step", "param", "diff_ws1")},
    ),
    Check(grads_match_ws1, multi_rank("replicated"), {"scenarios": ROW, "steps": _STEPS + ("grad_diff_ws1",)}),
    Check(
        split_matches_full_batch,
        multi_rank("split"),
        {"scenarios": ROW + ("steps", "lr"), "params": ("scenario", "step", "param", "diff_ref")},
    ),
    Check(converges, not_reference, {"scenarios": ROW, "steps": _STEPS}),
    Check(
        params_cover_model,
        not_reference,
        {"scenarios": ROW + ("params_compared",), "coverage": ("scenario", "step", "param", "problem")},
    ),
)
