"""The report's section on the models' own sensitivity: per noise probe, how many parameters are
model-sensitive (held to their noise floor instead of the split tier's bound), which, and their floors
(harness/core/policy.py [Note: noise floor]; harness.checks.noise_floor)."""

from __future__ import annotations

import pandas as pd

from harness.checks.noise_floor import sensitivity_table
from harness.core.policy import NOISE_FLOOR_FACTOR
from harness.report.formatting import md_table, num


def noise_section(tables: dict) -> list[str]:
    table = sensitivity_table(tables)
    if not len(table):
        return []
    out = [
        "## Model sensitivity (noise floors)",
        "",
        "Split data is held to the full-batch model with the split tier's bound, parameter by parameter. Each "
        "model's own sensitivity is measured first: the plain model takes the same step on the same batch cut "
        "into the ranks' slices (the noise probe, no sharding code), and how far each parameter lands from the "
        "full batch is its noise floor. A parameter whose gradient is at its rounding-noise level (an attention "
        "key bias, a bias before a BatchNorm) moves by about lr whichever way its noise points under AdamW: it is "
        f"**model-sensitive, held to its noise floor** ({NOISE_FLOOR_FACTOR:g} x the floor) instead of the tier's "
        "bound; under AdamW to the larger of that and AdamW's reach (the most two runs can part by in that many "
        "steps, whatever their gradients: a trajectory set by rounding residues has no tighter bound). Every other "
        "parameter keeps the tier's bound unchanged.",
        "",
    ]
    hot = table[table.sensitive > 0]
    per_model = (
        table.groupby("model")
        .agg(probes=("probe", "size"), params=("params", "max"), sensitive=("sensitive", "max"))
        .reset_index()
    )
    per_model = per_model.rename(columns={"params": "parameters", "sensitive": "model-sensitive (most in a probe)"})
    out += [md_table(per_model), ""]
    if not len(hot):
        out += ["No parameter of any model is model-sensitive: every one is held to the tier's bound.", ""]
        return out
    shown = pd.DataFrame(
        {
            "model": hot.model,
            "optimizer": hot.optimizer,
            "feature": hot.feature,
            "seed": hot.seed,
            "ranks' slices": hot.micro_batches,
            "tier bound": hot.tier_bound.map(num),
            "model-sensitive parameters (floor)": hot.which,
        }
    )
    return out + [md_table(shown), ""]
