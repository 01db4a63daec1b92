"""Checks that only some features have: a checkpoint restores what was saved (ckpt), mixed precision
acts at all (bf16), the replicas of a hybrid mesh hold the same parameters (hsdp), two factorisations
of one global batch agree (accum, no_sync), the eval loss matches (eval), delays change no number (jitter). The per-step equivalence of every feature is checked by harness/checks/numeric.py."""

from __future__ import annotations

import math
import struct

import pandas as pd

from harness.checks.common import ROW, Check, by_scenario, first_param_crossing, fmt, judge, not_measured, ok_rows
from harness.checks.noise_floor import batch_stats_of, holding, probe_maxima, weighted_loss_of
from harness.core.features import has, passes_per_step, rounded_per_rank, shard_size
from harness.core.policy import BF16_SPLIT, Bounds, not_exact
from harness.core.scenario import REFERENCE_IMPL, Scenario, ckpt_step, feature_of, resume_of, widest
from harness.core.verdict import SKIP, Verdict

# the built-in optimizers that keep state after a step (AdamW's moments, SGD's momentum): a checkpoint of theirs
# that holds none lost it
STATEFUL = ("adamw", "sgd")


def ckpt_restored(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """A resumed run right after loading holds bitwise what its saver held when it saved (at every
    world size: loading copies values, it computes nothing): its parameters, and every value of the
    optimizer state its ranks hold (exp_avg, exp_avg_sq, the step counter, momentum), element for
    element, each rank's part at the rows its layout gives it (harness.tables.restored_state).
    Misplaced rows (padding, shard offsets) and misplaced or lost optimizer state show here, at the
    checkpoint's step, not only in whatever the steps after make of them."""
    out = []
    for row in ok_rows(tables["scenarios"]).itertuples():
        if resume_of(row) == 0:
            continue
        step, saver = ckpt_step(int(row.steps)), Scenario.of_row(row).saver().id
        params, state = _number(getattr(row, "restore_diff", None)), _number(getattr(row, "state_restore_diff", None))
        where, what = _text(row, "state_restore_where"), _text(row, "state_restored")
        missing = (
            [f"no parameters of {row.scenario} after loading, or of {saver} at step {step}"]
            if math.isnan(params)
            else []
        )
        if math.isnan(state):
            missing.append(
                f"no optimizer state of {row.scenario} after loading compared with {saver}'s at step "
                f"{step} ({where or 'none recorded'})"
            )
        elif what == "none saved" and row.optimizer in STATEFUL:
            missing.append(
                f"{saver}'s ranks held no optimizer state the census could place at step {step}, where "
                f"{row.optimizer} keeps state after every step (the implementation keeps it where the optimizer's "
                "parameter groups do not name it)"
            )
        if missing:
            out.append(not_measured("ckpt_restored", row, "; ".join(missing), 0.0))
            continue
        failed = []
        if params != 0:
            failed.append(
                f"parameters after loading differ from those saved by {saver}: max |diff| {fmt(params)} "
                f"({_text(row, 'restore_param')})"
            )
        if state != 0:
            failed.append(f"optimizer state after loading differs from what {saver}'s ranks held when saving: {where}")
        msg = (
            "; ".join(failed) + f", at step {step}"
            if failed
            else f"parameters and optimizer state after loading at {int(row.world_size)} ranks bitwise those saved "
            f"at {resume_of(row)} (optimizer state: {what})"
        )
        param = _text(row, "restore_param") if params != 0 else _text(row, "state_restore_param")
        rank = _number(getattr(row, "state_restore_rank", None)) if params == 0 else math.nan
        out.append(
            judge(
                "ckpt_restored",
                row,
                not failed,
                max(params, state),
                0.0,
                msg,
                step=step,
                param=param,
                rank=None if math.isnan(rank) else int(rank),
            )
        )
    return out


def _number(x) -> float:
    return math.nan if x is None or (isinstance(x, str) and not x) else float(x)


def _text(row, column: str) -> str:
    x = getattr(row, column, "")
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x)


def bf16_acts(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """The plain model under the bf16 policy trains differently from the plain model in fp32 at some
    step: otherwise the policy did nothing and every bf16 comparison would be one of fp32 runs."""
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    for row in ok_rows(sc).itertuples():
        if row.impl != REFERENCE_IMPL or not has(feature_of(row), "bf16"):
            continue
        drift = steps[steps.scenario == row.scenario].max_diff_ref
        if not len(drift) or drift.isna().all():
            out.append(not_measured("bf16_acts", row, "no parameter difference to the plain fp32 model recorded"))
            continue
        worst = float(drift.max())
        msg = (
            f"bf16 moves the plain model by up to {fmt(worst)} from its fp32 run (the drift)"
            if worst > 0
            else "the plain model under the bf16 policy trains bitwise like in fp32: the policy did nothing"
        )
        out.append(judge("bf16_acts", row, worst > 0, worst, 0.0, msg))
    return out


def factorisations_agree(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Split data, k micro-batches at W ranks (accum, no_sync) against the same implementation's plain
    step at W x k ranks: two factorisations (world size x local batch x micro-batches) of one global
    batch, W x k pieces of one size grouped otherwise, so the same training within the split tier's bound,
    parameter by parameter, at every step. Each is a cut of the batch like the run's noise probes, so
    each parameter is held as split data holds it
    (harness/core/policy.py [Note: noise floor]): the tier's bound, or a model-sensitive parameter's floor
    or reach. Both are also held to the full batch; this holds the implementation to itself."""
    out = []
    sc, params = tables["scenarios"], tables["params"]
    done, known = set(ok_rows(sc).scenario), set(sc.scenario)
    params_of = by_scenario(params)
    maxima = probe_maxima(tables)
    for row in ok_rows(sc).itertuples():
        scen = Scenario.of_row(row)
        twin = scen.factor_twin()
        if twin is None:
            continue
        k = passes_per_step(feature_of(row))
        if twin.id not in done:
            why = "is not in this run" if twin.id not in known else "did not complete"
            out.append(
                Verdict(
                    "factorisations_agree",
                    row.scenario,
                    SKIP,
                    None,
                    None,
                    message=(
                        f"does not apply: its other factorisation, {twin.id} ({int(row.world_size) * k} ranks x 1 "
                        f"micro-batch), {why}"
                    ),
                )
            )
            continue
        # a rank's k micro-batches (contiguous pieces of its slice) are not the W x k ranks' slices: where each
        # group of samples is rounded (bf16) or normalised (batch statistics) on its own, two computations
        apart = (
            f"{BF16_SPLIT}; the two round different groups of samples to bf16"
            if rounded_per_rank(scen.feature)
            else f"the model normalises with batch statistics ({batch_stats_of(row)}); the two normalise "
            "different groups of samples"
            if batch_stats_of(row)
            else "the loss is a mean weighted by a count each sample carries (a token mean); the two normalise "
            "different groups of samples by their own counts"
            if weighted_loss_of(row)
            else ""
        )
        if apart:
            out.append(
                Verdict(
                    "factorisations_agree",
                    row.scenario,
                    SKIP,
                    None,
                    None,
                    message=(
                        f"does not apply: {apart}, since a rank's {k} micro-batches (contiguous pieces of its slice) are not "
                        f"the {int(row.world_size) * k} ranks' slices: two different computations, each held to its own "
                        "ranks' micro-batches by split_matches_full_batch"
                    ),
                )
            )
            continue
        # the floors of both cuts: at W = 1 the run has no probe of its own, its twin's slices have one
        probes = list(dict.fromkeys(scen.noise_probes() + twin.noise_probes()))
        lost = [p.id for p in probes if p.id not in done]
        bound = bounds.split_bound(row.optimizer, row.lr, int(row.steps))
        if lost:
            out.append(not_measured("factorisations_agree", row, f"the noise probe {lost[0]} did not complete", bound))
            continue
        hold = holding(row, maxima, probes, False, bounds)
        rows = params_of.get(row.scenario)
        at, worst = first_param_crossing(rows, "diff_factor", hold.held, bound, set(hold.hot))
        msg = (
            f"{int(row.world_size)} ranks x {k} micro-batches vs {int(row.world_size) * k} ranks x 1: max |param "
            f"diff| {fmt(worst)} (bound {bound:.3g}, the split tier's)"
        )
        if hold.hot and rows is not None:
            msg += hold.note(rows.groupby("param").diff_factor.max())
        out.append(judge("factorisations_agree", row, at is None and not math.isnan(worst), worst, bound, msg, at=at))
    return out


def replicas_agree(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Hybrid sharding: after every step each rank's own parameter parts are bitwise those of the first
    replica's rank with the same index (the replicas average the same gradient and step alike).
    Read on every rank: the parameters the adapter reports may come from the first replica alone."""
    out = []
    sc, steps_of = tables["scenarios"], by_scenario(tables["steps"])
    for row in ok_rows(sc).itertuples():
        if not _hybrid(row):
            continue
        mine = _own_steps(steps_of, row)
        if not len(mine) or mine.replicas_differ.isna().any():
            out.append(not_measured("replicas_agree", row, "no comparison of the replicas' parameters recorded", 0.0))
            continue
        bad = mine[mine.replicas_differ > 0]
        replicas = int(row.world_size) // shard_size("hsdp", int(row.world_size))
        if not len(bad):
            out.append(
                judge(
                    "replicas_agree",
                    row,
                    True,
                    0.0,
                    0.0,
                    f"the {replicas} replicas hold bitwise the same parameters after every step",
                )
            )
            continue
        first = bad.iloc[0]
        out.append(
            judge(
                "replicas_agree",
                row,
                False,
                float(bad.replicas_differ.max()),
                0.0,
                f"{int(first.replicas_differ)} of {int(row.world_size)} ranks hold parameters that differ "
                f"from their first replica's after step {int(first.step)}",
                step=int(first.step),
                param="replica parameters",
            )
        )
    return out


def ranks_agree(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """W > 1: every rank records the same loss, the same clipping norm (what its clip_grad_norm returned) and
    the same eval loss as rank 0 at every step, bitwise: all are global figures. An implementation whose ranks > 0 return the
    norm of their own shard, or compute another loss, fails here, naming the rank and the figure."""
    out = []
    sc, steps_of = tables["scenarios"], by_scenario(tables["steps"])
    for row in ok_rows(sc).itertuples():
        if int(row.world_size) < 2:
            continue
        mine = _own_steps(steps_of, row)
        if not len(mine) or "reports_differ" not in mine:
            out.append(not_measured("ranks_agree", row, "no comparison of the ranks' step records", 0.0))
            continue
        said = mine.reports_differ.fillna("").astype(str)
        bad = mine[said != ""]
        if not len(bad):
            out.append(
                judge(
                    "ranks_agree",
                    row,
                    True,
                    0.0,
                    0.0,
                    f"all {int(row.world_size)} ranks record rank 0's loss, clipping norm and eval loss at every step",
                )
            )
            continue
        first = bad.iloc[0]
        rank, rest = str(first.reports_differ).split(",")[0].split(":", 1)
        field, value = rest.split("=", 1)
        theirs = getattr(first, field if field in ("loss", "eval_loss") else "clip_norm", None)
        out.append(
            judge(
                "ranks_agree",
                row,
                False,
                None,
                0.0,
                f"rank {rank} recorded {field} {value} at step {int(first.step)} where rank 0 recorded "
                f"{theirs!r} (a global figure, the same on every rank); ranks and fields that differ: "
                f"{first.reports_differ}",
                step=int(first.step),
                param=field,
                rank=int(rank),
                where=f"rank {rank} {field}",
            )
        )
    return out


def jitter_invariant(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """A run under timing perturbation (jitter) holds bit for bit the losses and parameters (the snapshots
    after every step, from the initial ones on) of the same run without it, its calm twin (Scenario.calm):
    delays change when things happen, never what is computed. It must have been perturbed: a run in which no
    delay was injected measured nothing. Fails naming the first step, and the parameter and element (both
    values) or the loss, that differ; a NaN or infinity counts as a difference even in both runs (equal bits
    there prove nothing: any two computations that overflow alike look the same)."""
    out = []
    sc, steps_of = tables["scenarios"], by_scenario(tables["steps"])
    done, known = set(ok_rows(sc).scenario), set(sc.scenario)
    for row in ok_rows(sc).itertuples():
        calm = Scenario.of_row(row).calm()
        if calm is None:
            continue
        if calm.id not in done:
            why = "is not in this run" if calm.id not in known else "did not complete"
            out.append(not_measured("jitter_invariant", row, f"its calm twin {calm.id} {why}", 0.0))
            continue
        mine, theirs = steps_of.get(row.scenario), steps_of.get(calm.id)
        compared = getattr(row, "calm_compared", math.nan)
        if mine is None or theirs is None or not compared or compared != compared:
            out.append(
                not_measured("jitter_invariant", row, f"no parameters of it and of {calm.id} at the same step", 0.0)
            )
            continue
        delays = float(mine.jitter_delays.fillna(0).sum())
        if delays <= 0:
            out.append(not_measured("jitter_invariant", row, "no delay was injected: nothing was perturbed", 0.0))
            continue
        found = []  # (step, param, what)
        param_step = getattr(row, "calm_step", math.nan)
        if param_step == param_step and param_step is not None:
            found.append((int(param_step), str(row.calm_param), f"{row.calm_param} {row.calm_element}"))
        calm_loss = dict(zip(theirs.step, theirs.loss))
        for step, loss in sorted(zip(mine.step, mine.loss)):
            other = calm_loss.get(step)
            if other is None or _bits(loss) != _bits(other) or not math.isfinite(loss):
                found.append((int(step), "loss", f"loss {loss!r} vs {other!r}"))
                break
        seconds = float(mine.jitter_s.fillna(0).sum())
        perturbed = f"{int(delays)} delays over all ranks ({seconds:.2f} s)"
        if not found:
            out.append(
                judge(
                    "jitter_invariant",
                    row,
                    True,
                    0.0,
                    0.0,
                    f"losses and parameters bitwise those of {calm.id} at every step ({int(compared)} "
                    f"parameter snapshots) under {perturbed}",
                )
            )
            continue
        step, param, what = min(found, key=lambda f: (f[0], f[1] == "loss"))  # a parameter before the loss
        out.append(
            judge(
                "jitter_invariant",
                row,
                False,
                None,
                0.0,
                f"under {perturbed} the run parts from its calm twin {calm.id} (or either is not finite) at "
                f"step {step}: {what} (jitter, calm): the numbers depend on when the ranks get somewhere (a "
                "read of a collective's output before its wait, a race)",
                step=step,
                param=param,
            )
        )
    return out


def _bits(x) -> bytes:
    return struct.pack("<d", float(x))


def _own_steps(steps_of: dict, row) -> pd.DataFrame:
    """The steps-table rows of the steps a run trained itself, in order: a resumed run's steps before its
    checkpoint are its saver's, recorded on the saver's ranks and mesh."""
    mine = steps_of.get(row.scenario)
    if mine is None:
        return pd.DataFrame(columns=["step", "replicas_differ", "reports_differ"])
    mine = mine.sort_values("step")
    return mine[mine.step > ckpt_step(int(row.steps))] if resume_of(row) else mine


def _hybrid(row) -> bool:
    return (
        row.status == "ok"
        and has(feature_of(row), "hsdp")
        and shard_size("hsdp", int(row.world_size)) < int(row.world_size)
    )


def _multi_rank_ok(row) -> bool:
    return row.status == "ok" and int(row.world_size) > 1


def eval_matches(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Feature eval: the loss of the no_grad forward on the held-out batch after each step, by the tier of the
    data mode (harness/core/policy.py [Note: eval loss]): bitwise the plain model's at W = 1 and the same
    implementation's at W = 1 with replicated data; with split data (or L2 clipping) the plain model's eval
    loss at the run's own parameters (eval_loss_plain), within the relative tier, at every step it trained."""
    out = []
    sc = tables["scenarios"]
    done = set(ok_rows(sc).scenario)
    steps = {s: g.sort_values("step").set_index("step") for s, g in by_scenario(tables["steps"]).items()}
    evals = {s: g.eval_loss for s, g in steps.items()}
    for row in ok_rows(sc)[lambda d: d.impl != REFERENCE_IMPL].itertuples():
        if not has(feature_of(row), "eval"):
            continue
        scen = Scenario.of_row(row)
        exact = widest(row) == 1 or (row.data_mode == "replicated" and not not_exact(scen.feature, scen.optimizer))
        mine = evals.get(row.scenario)
        if exact:
            yard = scen.reference().id if widest(row) == 1 else scen.ws1().id
            theirs = evals.get(yard) if yard in done else None
            what = f"no eval loss of {yard}" if theirs is None or theirs.isna().all() else None
            bound = pd.Series(0.0, index=mine.index) if mine is not None else None
            why = (
                "bitwise, as ws1_exact holds the training loss"
                if widest(row) == 1
                else "bitwise: replicated data, parameters held bitwise to world size 1"
            )
            against = yard
        else:
            own = steps[row.scenario]
            if mine is not None and "eval_loss_plain" in own:
                trained = own.index > (ckpt_step(int(row.steps)) if scen.resume_from else 0)  # the rest: its saver's
                mine, theirs = mine[trained], own.eval_loss_plain[trained]
            else:
                theirs = None
            what = (
                "no eval loss of the plain model at the run's parameters"
                if theirs is None or theirs.isna().any()
                else None
            )
            bound = bounds.eval_loss_rel * theirs.abs() if what is None else None
            why = f"{bounds.eval_loss_rel:g} x |its eval loss|"
            against = "the plain model at the run's own parameters (eval_loss_plain)"
        if mine is None or mine.isna().all() or what:
            out.append(not_measured("eval_matches", row, what or f"no eval loss recorded for {row.scenario}", 0.0))
            continue
        diff = (mine - theirs.reindex(mine.index)).abs()
        over = diff[diff.isna() | (diff > bound.reindex(mine.index))]  # bitwise tiers: a bound of 0
        worst = float(diff.max())
        msg = f"max |eval loss diff| vs {against} = {fmt(worst)} over {len(mine)} steps (bound: {why})"
        if not len(over):
            out.append(judge("eval_matches", row, True, worst, float(bound.max()), msg))
            continue
        k = int(over.index[0])
        out.append(
            judge(
                "eval_matches",
                row,
                False,
                worst,
                float(bound.max()),
                f"{msg}; first at step {k}: {float(mine[k])!r} vs {float(theirs.get(k, math.nan))!r}",
                step=k,
                param="eval loss",
                where=fmt(float(diff[k])),
            )
        )
    return out


def _factorised(row) -> bool:
    return (
        row.status == "ok"
        and row.data_mode == "split"
        and passes_per_step(feature_of(row)) > 1
        and row.impl != REFERENCE_IMPL
    )


def _resumed(row) -> bool:
    return row.status == "ok" and resume_of(row) > 0


def _evaluated(row) -> bool:
    return row.status == "ok" and row.impl != REFERENCE_IMPL and has(feature_of(row), "eval")


def _jittered(row) -> bool:
    return row.status == "ok" and has(feature_of(row), "jitter")


def _bf16_reference(row) -> bool:
    return row.status == "ok" and row.impl == REFERENCE_IMPL and has(feature_of(row), "bf16")


FEATURE_CHECKS = (
    Check(ckpt_restored, _resumed, {"scenarios": ROW + ("steps", "restore_diff", "state_restore_diff")}),
    Check(bf16_acts, _bf16_reference, {"scenarios": ROW, "steps": ("scenario", "step", "max_diff_ref")}),
    Check(ranks_agree, _multi_rank_ok, {"scenarios": ROW + ("steps",), "steps": ("scenario", "step", "loss")}),
    Check(replicas_agree, _hybrid, {"scenarios": ROW, "steps": ("scenario", "step", "replicas_differ")}),
    Check(eval_matches, _evaluated, {"scenarios": ROW + ("steps",), "steps": ("scenario", "step", "eval_loss")}),
    Check(
        jitter_invariant,
        _jittered,
        {
            "scenarios": ROW + ("calm_step", "calm_param", "calm_element", "calm_compared"),
            "steps": ("scenario", "step", "loss", "jitter_delays", "jitter_s"),
        },
    ),
    Check(
        factorisations_agree,
        _factorised,
        {"scenarios": ROW + ("steps", "lr"), "params": ("scenario", "step", "param", "diff_factor")},
    ),
)
