"""Noise floors: each parameter's own sensitivity to cutting the batch into the ranks' slices, measured on
the plain model by its noise probes (harness/core/policy.py [Note: noise floor]), and what a split run's
parameters are held to. Pure functions over the run's tables."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from harness.core.features import rounded_per_rank
from harness.core.policy import BATCH_STATS_SPLIT, NOISE_FLOOR_FACTOR, Bounds, model_sensitive, noise_floor_bound
from harness.core.scenario import REFERENCE_IMPL, Scenario, feature_of, resume_of, user_optimizer

SENSITIVITY_COLUMNS = (
    "probe",
    "model",
    "optimizer",
    "seed",
    "feature",
    "micro_batches",
    "params",
    "sensitive",
    "tier_bound",
    "which",
)


def probe_maxima(tables) -> pd.DataFrame:
    """(scenario, param) -> the largest diff_ref and diff_probe over the steps, and the travel summed over them
    (how far the run moved the parameter, step by step), for the plain model's runs (the noise probes, and the
    full-batch references whose travel a user's optimizer's reach reads): read once per run, each split
    scenario's floor picks its rows."""
    sc, params = tables.get("scenarios"), tables.get("params")
    if (
        not isinstance(sc, pd.DataFrame)
        or not isinstance(params, pd.DataFrame)
        or not len(params)
        or "micro_batches" not in sc
    ):
        return pd.DataFrame(columns=["diff_ref", "diff_probe", "travel"])
    rows = params[params.scenario.isin(set(sc.scenario[sc.impl == REFERENCE_IMPL]))]
    how = {c: ("sum" if c == "travel" else "max") for c in ("diff_ref", "diff_probe", "travel") if c in rows}
    return rows.groupby(["scenario", "param"]).agg(how) if len(rows) else pd.DataFrame(columns=list(how))


def floors(maxima: pd.DataFrame, probes: list[Scenario], against_probe: bool = False) -> dict[str, float]:
    """parameter -> its noise floor: the largest |param diff| of any of the probes from the reference it
    perturbs at any step (diff_ref: the full-batch reference; `maxima`: probe_maxima). `against_probe`
    (a model with batch statistics, held to its rank-order probe; bf16, whose reference is that probe): for
    a probe of the ranks' micro-batches, the largest |param diff| of a reversed or nudged probe from its
    rank-order twin (diff_probe), what the order of summation alone changes."""
    if not len(maxima):
        return {}
    have = set(maxima.index.get_level_values("scenario"))
    parts = []
    for p in probes:
        col = "diff_probe" if against_probe and p.micro_batches > 1 else "diff_ref"
        if (col == "diff_probe" and not (p.reverse_micro or p.nudge)) or col not in maxima or p.id not in have:
            continue
        parts.append(maxima.loc[p.id][col])
    if not parts:
        return {}
    return {q: float(v) for q, v in pd.concat(parts).groupby(level=0).max().items()}


def held_bounds(
    floor: dict[str, float], tier_bound: float, reach: float = 0.0, travel: dict[str, float] | None = None
) -> dict[str, float]:
    """parameter -> the bound it is held to: the tier's, or for a model-sensitive one the larger of 2 x its
    floor and the optimizer's reach (policy.noise_floor_bound): AdamW's `reach`, or a user's optimizer's
    measured one, `travel` (measured_reach)."""
    travel = travel or {}
    return {p: noise_floor_bound(tier_bound, f, max(reach, travel.get(p, 0.0))) for p, f in floor.items()}


def measured_reach(maxima: pd.DataFrame, runs: list[Scenario]) -> dict[str, float]:
    """parameter -> a user's optimizer's reach on it, measured ([Note: user optimizer] in harness/core/policy.py):
    twice the furthest any of the plain model's `runs` (the full-batch reference and the noise probes) travelled
    it, each step's ||step||_F summed over the steps (probe_maxima's travel)."""
    if "travel" not in maxima or not len(maxima):
        return {}
    have = set(maxima.index.get_level_values("scenario"))
    parts = [maxima.loc[r.id]["travel"] for r in runs if r.id in have]
    if not parts:
        return {}
    return {q: 2 * float(v) for q, v in pd.concat(parts).groupby(level=0).max().items() if v == v}


def sensitive(floor: dict[str, float], tier_bound: float) -> dict[str, float]:
    """The model-sensitive parameters (held to their floor or reach, not to the tier's bound) -> their floor."""
    return {p: f for p, f in floor.items() if model_sensitive(tier_bound, f)}


@dataclass(frozen=True)
class Holding:
    """How one split run's parameters are held: the tier's bound, each parameter's bound (held), the
    model-sensitive ones with their floors (hot), and the optimizer's reach that lifts them."""

    tier: float
    held: dict[str, float]
    hot: dict[str, float]
    reach: float
    measured_reach: bool = False  # a user's optimizer: each parameter's reach measured (measured_reach)

    def note(self, measured: pd.Series) -> str:
        return sensitive_note(self.hot, self.held, measured, self.reach, self.measured_reach)


def holding(row, maxima: pd.DataFrame, probes: list[Scenario], against_probe: bool, bounds: Bounds) -> Holding:
    """The Holding of a split row whose noise probes are `probes` (floors: `against_probe` as in floors)."""
    tier = bounds.split_bound(row.optimizer, float(row.lr), int(row.steps))
    floor, reach = floors(maxima, probes, against_probe), bounds.reach(row.optimizer, float(row.lr), int(row.steps))
    travel = (
        measured_reach(maxima, [Scenario.of_row(row).reference(), *probes]) if user_optimizer(row.optimizer) else {}
    )
    return Holding(tier, held_bounds(floor, tier, reach, travel), sensitive(floor, tier), reach, bool(travel))


def sensitive_note(
    hot: dict[str, float], held: dict[str, float], measured: pd.Series, reach: float, measured_reach: bool = False
) -> str:
    """'; 2 of 27 parameters model-sensitive, ...: name value (floor f, bound b); ...' ('' for none):
    what a split verdict says of the parameters it holds to their floor or the optimizer's reach."""
    if not hot:
        return ""
    how = (
        f"held to the larger of {NOISE_FLOOR_FACTOR:g} x their noise floor and AdamW's reach {reach:.3g} (the most "
        "any two runs can part by; their gradient is rounding noise, so nothing tighter holds)"
        if reach
        else f"held to the larger of {NOISE_FLOOR_FACTOR:g} x their noise floor and the optimizer's measured reach (twice "
        "the furthest the plain model's own runs moved each, step by step; their gradient is rounding noise, so "
        "nothing tighter holds)"
        if measured_reach
        else f"held to {NOISE_FLOOR_FACTOR:g} x their noise floor"
    )
    return (
        f"; {len(hot)} of {len(held)} parameters model-sensitive (how far the plain model itself moves when the batch is cut "
        f"into the ranks' slices), {how}: "
        + "; ".join(
            f"{p} {float(measured.get(p, math.nan)):.3g} (floor {f:.3g}, bound {held[p]:.3g})"
            for p, f in sorted(hot.items(), key=lambda kv: -kv[1])
        )
    )


def batch_stats_of(row) -> str:
    """A scenarios-table row's layers that use batch statistics ("" for none, or a table stored before
    the column existed)."""
    value = getattr(row, "batch_stats", "")
    return value if isinstance(value, str) else ""


def weighted_loss_of(row) -> bool:
    """Whether a scenarios-table row's model has a loss weighted by a count each sample carries (a token mean;
    False for a table stored before the column existed)."""
    value = getattr(row, "weighted_loss", False)
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return value == value and bool(value)  # NaN: not recorded


# [Note: weighted loss] A loss that is a mean weighted by a count each sample carries (a token mean over the
# non-pad tokens) normalises each rank's slice by that slice's count, so split data averages the ranks' own means,
# not the global one; the run's plain model measures that difference (harness/checks/loop.py loss_normalisation)
# and the implementations are held to the computation with the same normalisation: docs/checks.md#weighted-losses
WEIGHTED_LOSS_SPLIT = (
    "the loss is a mean weighted by a count each sample carries (a token mean), so each rank normalises its own "
    "slice by its own count and split data averages the ranks' means, not the global mean (loss_normalisation "
    "measures what that changes); it is held to the plain model stepping on the sum of the same per-rank "
    "micro-batches instead"
)


def probe_cause(row) -> str:
    """Why a split row is held to its rank-order noise probe rather than to the full batch ('' where it is not):
    its model normalises with batch statistics (BATCH_STATS_SPLIT), or its loss normalises each rank's slice by
    that slice's own count (WEIGHTED_LOSS_SPLIT). Either way each rank's slice is its own computation, which the
    ranks' micro-batches, summed, are."""
    layers = batch_stats_of(row)
    if layers:
        return BATCH_STATS_SPLIT.format(layers=layers)
    return WEIGHTED_LOSS_SPLIT if weighted_loss_of(row) else ""


def split_yardstick(row) -> str:
    """The id of the run a split row's numbers are held to: the full-batch reference, or for a model with
    batch statistics or a weighted loss (probe_cause) the noise probe in rank order at the world size its first
    step was trained at (the equivalent computation; a resumed run's first steps are its saver's). Under a composition that rounds
    each rank's gradient (bf16+ckpt) a run resumed at another world size is held where its first steps were
    trained: to its saver's reference, the ranks' micro-batches at resume_from."""
    sc = Scenario.of_row(row)
    if row.data_mode == "split" and rounded_per_rank(sc.feature) and resumed_across_sizes(row):
        return sc.saver().reference().id
    probe = sc.rank_order_probe(at=sc.resume_from or sc.world_size)  # a resumed run's first steps: its saver's
    if row.data_mode == "split" and probe_cause(row) and probe is not None:
        return probe.id
    return sc.reference().id


def sensitivity_table(tables, bounds: Bounds = Bounds()) -> pd.DataFrame:
    """One row per noise probe that ran: how many of the model's parameters it found model-sensitive
    under the split tier's bound of its optimizer, lr and steps, and which, with their floors."""
    sc, params = tables.get("scenarios"), tables.get("params")
    rows = []
    if isinstance(sc, pd.DataFrame) and isinstance(params, pd.DataFrame) and len(sc):
        probes = sc[(sc.impl == REFERENCE_IMPL) & (sc.status == "ok")]
        probes = probes[probes.apply(_is_probe, axis=1)] if len(probes) else probes
        maxima = probe_maxima(tables)
        for r in probes.itertuples():
            tier = bounds.split_bound(r.optimizer, float(r.lr), int(r.steps))
            probe, stats = Scenario.of_row(r), bool(probe_cause(r))
            if stats and probe.micro_batches > 1 and not (probe.reverse_micro or probe.nudge):  # the yardstick itself
                continue
            floor = floors(maxima, [probe], against_probe=stats or rounded_per_rank(probe.feature))
            hot = sensitive(floor, tier)
            which = "; ".join(f"{p} (floor {f:.3g})" for p, f in sorted(hot.items(), key=lambda kv: -kv[1]))
            rows.append(
                {
                    "probe": r.scenario,
                    "model": r.model,
                    "optimizer": r.optimizer,
                    "seed": int(r.seed),
                    "feature": feature_of(r),
                    "micro_batches": probe.micro_batches,
                    "params": len(floor),
                    "sensitive": len(hot),
                    "tier_bound": tier,
                    "which": which,
                }
            )
    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)


def _is_probe(row) -> bool:
    """A reference run that is some run's noise probe (not a ROUNDED_PER_RANK run's reference)."""
    sc = Scenario.of_row(row)
    return sc.nudge > 0 or (sc.micro_batches > 1 and (not rounded_per_rank(sc.feature) or sc.reverse_micro))


def resumed_across_sizes(row) -> bool:
    """A run trained at two world sizes (ckpt resumed at another W): no single probe is its computation."""
    return resume_of(row) not in (0, int(row.world_size))
