"""Checks of the training loop itself, measured on the plain model alone: no implementation is involved, so a
failure here is the loop's (the model's loss as split data uses it), never an implementation's, and it is given
on the plain model's run, counted with the yardstick (harness/core/outcome.py), not with the implementations.

loss_normalisation ([Note: weighted loss] in harness/checks/noise_floor.py): a loss that is a mean weighted by a
count each sample carries (a token mean over the non-pad tokens, as most language models train) normalises each
rank's slice by that slice's own count. Split data then trains on the average over the ranks of their own means,
which is not the global mean wherever the ranks' counts differ: the gradient-accumulation loss normalisation bug
in another form. The run has both computations on the plain model: the full batch (the global mean) and the noise
probe in rank order (the ranks' slices as micro-batches, each loss scaled by 1 / W: the average of the ranks'
means). At step 1 both start from the same parameters, so their gradients differ by rounding only where the
normalisation is the same (grad_norm_matches's bound, which holds every implementation to the same rounding);
beyond it, the loop trains another model than the full batch does, at every world size its own.
"""

from __future__ import annotations

import math

from harness.checks.common import ROW, Check, fmt, judge, not_measured, ok_row
from harness.checks.noise_floor import weighted_loss_of
from harness.core.features import passes_per_step, rounded_per_rank
from harness.core.policy import Bounds
from harness.core.scenario import REFERENCE_IMPL, Scenario

LOOP_FIX = (
    "normalise by the global count: sum the token losses of the rank's slice and divide by the count of "
    "non-pad tokens all-reduced over the ranks (times the world size where the gradients are averaged), so that "
    "every world size trains on the global token mean"
)


def averaged_means_probe(row) -> bool:
    """A plain-model run that averages the ranks' own means of a weighted loss: the noise probe in rank order at W
    > 1 (no reversed order, no nudge), of a step of one pass that rounds nothing per rank (the features whose
    micro-batches or bf16 copies normalise or round their own groups of samples are the probes' business alone)."""
    if not (ok_row(row) and row.impl == REFERENCE_IMPL and weighted_loss_of(row)):
        return False
    sc = Scenario.of_row(row)
    return (
        sc.micro_batches > 1
        and not sc.reverse_micro
        and not sc.nudge
        and passes_per_step(sc.feature) == 1
        and not rounded_per_rank(sc.feature)
    )


def loss_normalisation(tables, bounds: Bounds = Bounds()) -> list:
    """The average over W ranks of their own means of a weighted loss against the global mean, on the plain model
    at step 1 (same parameters): the gradient norm within grad_norm_rel relative, as rounding alone allows; the
    loss and how far the parameters part by the last step are shown beside it."""
    out, bound = [], bounds.grad_norm_rel
    sc, steps = tables["scenarios"], tables["steps"]
    first = {s: g.sort_values("step") for s, g in steps.groupby("scenario")} if len(steps) else {}
    for row in sc[sc.apply(averaged_means_probe, axis=1)].itertuples() if len(sc) else ():
        probe = Scenario.of_row(row)
        whole = probe.replace(micro_batches=1).id
        mine, ref = first.get(row.scenario), first.get(whole)
        if mine is None or ref is None or not len(mine) or not len(ref):
            missing = whole if ref is None or not len(ref) else row.scenario
            out.append(not_measured("loss_normalisation", row, f"no step-1 loss and gradient norm of {missing}", bound))
            continue
        a, b = mine.iloc[0], ref.iloc[0]
        if not (math.isfinite(b.grad_norm) and b.grad_norm and math.isfinite(b.loss) and b.loss):
            out.append(
                not_measured(
                    "loss_normalisation", row, f"the full batch's step-1 loss {b.loss} and norm {b.grad_norm}", bound
                )
            )
            continue
        rel = abs(a.grad_norm - b.grad_norm) / abs(b.grad_norm) if math.isfinite(a.grad_norm) else math.inf
        rel_loss = abs(a.loss - b.loss) / abs(b.loss)
        w, last = probe.micro_batches, mine.iloc[-1]
        tier = bounds.split_bound(row.optimizer, float(row.lr), int(row.steps))
        drift = float(last.get("max_diff_ref", math.nan))
        parted = (
            f"; by step {int(last.step)} the parameters part from full-batch training by up to {fmt(drift)} "
            f"({last.get('worst_param_ref', '')}; a split run is held to {tier:.3g} against the full batch)"
            if math.isfinite(drift)
            else ""
        )
        figures = (
            f"the average over {w} ranks of their own means of the loss against the global mean, on the plain model at "
            f"step {int(a.step)}: loss {a.loss:.9g} vs {b.loss:.9g} (relative {fmt(rel_loss)}), gradient norm "
            f"{a.grad_norm:.9g} vs {b.grad_norm:.9g}: relative difference {fmt(rel)} (bound {bound:g}, rounding)"
        )
        passed = rel <= bound
        msg = (
            f"{figures}: the ranks' counts normalise alike here"
            if passed
            else f"the training loop, not the implementation: {figures}{parted}. The loss is a mean weighted by a "
            f"count each sample carries (a token mean), so each rank divides by its own count and split data at {w} "
            f"ranks trains another model than one rank does. Fix: {LOOP_FIX}. The implementations are held to "
            f"this run ({row.scenario}), the same normalisation"
        )
        out.append(judge("loss_normalisation", row, passed, rel, bound, msg, step=int(a.step), param="gradient norm"))
    return out


LOOP_CHECKS = (
    Check(
        loss_normalisation,
        averaged_means_probe,
        {"scenarios": ROW + ("steps", "lr", "weighted_loss"), "steps": ("scenario", "step", "loss", "grad_norm")},
    ),
)
