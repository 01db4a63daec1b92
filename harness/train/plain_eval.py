"""Feature eval, held apart from the trajectory: the eval loss the plain model gives at the parameters a run's
steps left.

Rank 0 computes it once the run has trained and been measured (nothing of it is in a measured step), from the
run's own snapshots (``step<k>.pt``, what the parameter checks compare), on the held-out batch cut as the run cut
it. `eval_matches` holds the run's eval loss to it where no bitwise tier applies (harness/core/policy.py
[Note: eval loss]): a forward that computes with other parameters than the step left parts from it, while the
parameters' own distance from the yardstick is the parameter checks' to judge.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from harness.adapters.reference import MixedPrecision
from harness.core.features import has
from harness.core.scenario import Scenario, ckpt_step
from harness.train.data import eval_batch
from harness.train.features import BF16_POLICY, evaluate, rank_slices
from harness.train.params_file import load_params


def held_out_cut(sc: Scenario, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A held-out batch (harness.train.data.eval_batch) as the run's ranks evaluate it together: every rank's
    slice under split data (a reference's micro-batches: its ranks' slices), the whole batch when replicated."""
    if sc.micro_batches > 1:
        return rank_slices(inputs, targets, sc.micro_batches)
    if sc.data_mode == "split" and sc.world_size > 1:
        return rank_slices(inputs, targets, sc.world_size)
    return [(inputs, targets)]


def add_plain_eval_losses(sc: Scenario, spec, snap_dir: Path, steps: list[dict], device) -> None:
    """Set ``eval_loss_plain`` in each step record of `steps` that this run trained (a resumed run's first
    records are its saver's, which evaluated them at its own world size): the mean over the cut's slices of
    the plain model's no_grad loss at the snapshot's parameters (in bf16 under bf16, as the reference
    computes). NaN where the snapshot does not name exactly the plain model's parameters (params_cover_model
    says what is missing)."""
    model = spec.build().to(device)
    forward = MixedPrecision(model, BF16_POLICY["param_dtype"]) if has(sc.feature, "bf16") else model
    params = dict(model.named_parameters())
    first = ckpt_step(sc.steps) + 1 if sc.resume_from else 1
    for rec in steps:
        if rec["step"] < first:
            continue
        full = load_params(snap_dir / f"step{rec['step']}.pt")
        if set(full) != set(params):
            rec["eval_loss_plain"] = math.nan
            continue
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(full[name])
        cut = held_out_cut(sc, *eval_batch(spec, sc.global_batch, rec["step"], sc.seed))
        slices = [(x.to(device), y.to(device)) for x, y in cut]
        losses = evaluate(sc.feature, spec, forward, slices)
        rec["eval_loss_plain"] = math.fsum(losses) / len(losses)
