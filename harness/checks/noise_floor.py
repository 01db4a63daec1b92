"""Noise floors: each parameter's own sensitivity to cutting the batch into the ranks' slices, measured on
the plain model by its noise probes (harness/core/policy.py [Note: noise floor]), and what a split run's
parameters are held to. Pure functions over the run's tables."""

from __future__ import annotations

import pandas as pd

from harness.core.policy import Bounds, noise_floor_bound
from harness.core.scenario import ROUNDED_PER_RANK, REFERENCE_IMPL, Scenario, feature_of, resume_of

SENSITIVITY_COLUMNS = ("probe", "model", "optimizer", "seed", "feature", "micro_batches", "params", "sensitive",
                       "tier_bound", "which")


def probe_maxima(tables) -> pd.DataFrame:
    """(scenario, param) -> the largest diff_ref and diff_probe over the steps, for the reference runs that
    are noise probes (micro_batches > 1): read once per run, each split scenario's floor picks its rows."""
    sc, params = tables.get("scenarios"), tables.get("params")
    if not isinstance(sc, pd.DataFrame) or not isinstance(params, pd.DataFrame) or not len(params) \
            or "micro_batches" not in sc:
        return pd.DataFrame(columns=["diff_ref", "diff_probe"])
    probe_ids = sc.scenario[(sc.impl == REFERENCE_IMPL) & (pd.to_numeric(sc.micro_batches, errors="coerce") > 1)]
    rows = params[params.scenario.isin(set(probe_ids))]
    cols = [c for c in ("diff_ref", "diff_probe") if c in rows]
    return rows.groupby(["scenario", "param"])[cols].max() if len(rows) else pd.DataFrame(columns=cols)


def floors(maxima: pd.DataFrame, probes: list[Scenario], against_probe: bool = False) -> dict[str, float]:
    """parameter -> its noise floor: the largest |param diff| of any of the probes from the full-batch
    reference at any step (diff_ref; `maxima`: probe_maxima). `against_probe` (a model with batch
    statistics, held to its rank-order probe; bf16, whose reference is that probe): the largest |param
    diff| of a reversed probe from its rank-order twin (diff_probe), what the order of summation alone
    changes."""
    col = "diff_probe" if against_probe else "diff_ref"
    ids = [p.id for p in probes if p.reverse_micro or not against_probe]
    if col not in maxima or not len(maxima):
        return {}
    rows = maxima[maxima.index.get_level_values("scenario").isin(ids)]
    if not len(rows):
        return {}
    return {p: float(v) for p, v in rows[col].groupby(level="param").max().items()}


def held_bounds(floor: dict[str, float], tier_bound: float) -> dict[str, float]:
    """parameter -> the bound it is held to: the tier's, or its floor's where that is larger."""
    return {p: noise_floor_bound(tier_bound, f) for p, f in floor.items()}


def sensitive(floor: dict[str, float], tier_bound: float) -> dict[str, float]:
    """The model-sensitive parameters (held to their floor, not to the tier's bound) -> their floor."""
    return {p: f for p, f in floor.items() if noise_floor_bound(tier_bound, f) > tier_bound}


def batch_stats_of(row) -> str:
    """A scenarios-table row's layers that use batch statistics ("" for none, or a table stored before
    the column existed)."""
    value = getattr(row, "batch_stats", "")
    return value if isinstance(value, str) else ""


def split_yardstick(row) -> str:
    """The id of the run a split row's numbers are held to: the full-batch reference, or for a model with
    batch statistics the noise probe in rank order at the world size its first step was trained at (the
    equivalent computation; a resumed run's first steps are its saver's)."""
    sc = Scenario.of_row(row)
    probe = sc.rank_order_probe(at=sc.resume_from or sc.world_size)  # a resumed run's first steps: its saver's
    if row.data_mode == "split" and batch_stats_of(row) and probe is not None:
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
            probe, stats = Scenario.of_row(r), bool(batch_stats_of(r))
            if stats and not probe.reverse_micro:  # the yardstick itself (BATCH_STATS_SPLIT), no floor
                continue
            floor = floors(maxima, [probe], against_probe=stats or probe.feature in ROUNDED_PER_RANK)
            hot = sensitive(floor, tier)
            which = "; ".join(f"{p} (floor {f:.3g})" for p, f in sorted(hot.items(), key=lambda kv: -kv[1]))
            rows.append({"probe": r.scenario, "model": r.model, "optimizer": r.optimizer, "seed": int(r.seed),
                         "feature": feature_of(r), "micro_batches": probe.micro_batches,
                         "params": len(floor), "sensitive": len(hot), "tier_bound": tier, "which": which})
    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)


def _is_probe(row) -> bool:
    """A reference run that is some split run's noise probe (not a ROUNDED_PER_RANK run's reference)."""
    sc = Scenario.of_row(row)
    return sc.micro_batches > 1 and (sc.feature not in ROUNDED_PER_RANK or sc.reverse_micro)


def resumed_across_sizes(row) -> bool:
    """A run trained at two world sizes (ckpt resumed at another W): no single probe is its computation."""
    return resume_of(row) not in (0, int(row.world_size))
