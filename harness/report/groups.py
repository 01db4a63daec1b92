"""The run's tables as the report reads them: a table by name (empty when missing), one row per
scenario, and the non-reference scenarios grouped by (impl, model, data mode, optimizer, feature, seed)
across world sizes, with each group's reference scenario and its per-rank bytes per world size."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from harness.core.scenario import REFERENCE_IMPL, Scenario
from harness.core.verdict import Verdict
from harness.tables.store import rank_bytes

GROUP = ["impl", "model", "data_mode", "optimizer", "feature", "seed"]
RESUMED = " from "  # a resumed (ckpt) group's feature reads "ckpt from 8": its checkpoints were saved at 8 ranks


def table_or_empty(tables: dict, name: str) -> pd.DataFrame:
    df = tables.get(name) if tables else None
    if name == "verdicts" and isinstance(df, (list, tuple)):  # a list of Verdict is accepted too
        df = pd.DataFrame([v.as_dict() for v in df], columns=list(Verdict.__dataclass_fields__))
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


def group_label(key: tuple) -> str:
    impl, model, mode, opt, feature, seed = key
    return (
        f"{impl} · {model} · {mode} · {opt}"
        + (f" · {feature}" if feature != "plain" else "")
        + (f" · seed {seed}" if seed else "")
    )


def file_stem(key: tuple) -> str:
    """A group's key as a file-name stem for its plots (the plain feature and seed 0 left out)."""
    impl, model, mode, opt, feature, seed = key
    parts = [impl, model, mode, opt] + ([feature] if feature != "plain" else []) + ([seed] if seed else [])
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(str(k) for k in parts))


def cells_of(tables: dict) -> pd.DataFrame:
    """One row per scenario (the scenarios table, else scenario columns of the steps table)."""
    scen, steps = table_or_empty(tables, "scenarios"), table_or_empty(tables, "steps")
    cols = ["scenario", "impl", "model", "world_size", "data_mode", "optimizer", "seed"]
    cols += ["feature"] if "feature" in steps else []
    cells = scen if len(scen) else steps.drop_duplicates("scenario")[cols] if len(steps) else pd.DataFrame(columns=cols)
    if "feature" not in cells:  # a run stored before features existed
        cells = cells.assign(feature="plain")
    if "resume_from" in cells:  # resumed runs: one group per world size their checkpoint came from
        resumed = pd.to_numeric(cells["resume_from"], errors="coerce").fillna(0).astype(int)
        cells = cells.assign(feature=[f if r == 0 else f"{f}{RESUMED}{r}" for f, r in zip(cells["feature"], resumed)])
    return cells


def groups_of(cells: pd.DataFrame):
    """(key, rows sorted by world size) for every non-reference (impl, model, mode, optimizer, seed)."""
    if not len(cells):
        return []
    real = cells[cells["impl"] != REFERENCE_IMPL]
    return [(k, g.sort_values("world_size")) for k, g in real.groupby(GROUP, sort=False, dropna=False)]


def _group_scenario(key: tuple) -> Scenario:
    """A group's member at one rank (a resumed group's feature without its "from W")."""
    impl, model, mode, opt, feature, seed = key
    return Scenario(impl, model, 1, mode, opt, seed=int(seed), feature=feature.split(RESUMED)[0])


def group_reference(cells: pd.DataFrame, key: tuple) -> str | None:
    """The id of the run a group is compared with (`Scenario.reference`), if the run has it."""
    ref = _group_scenario(key).reference().id
    return ref if (cells["scenario"] == ref).any() else None


def references_per_ws(key: tuple, world_sizes) -> dict[int, str]:
    """World size -> the run a group's member at that size is compared with, where it is not the group's
    reference: the plain model summing the W ranks' micro-batches (split data under bf16)."""
    base = _group_scenario(key)
    refs = {int(w): base.at_world_size(int(w)).reference().id for w in world_sizes}
    return {w: r for w, r in refs.items() if r != base.reference().id}


def per_world_size(rows: pd.DataFrame, mem: pd.DataFrame) -> pd.DataFrame:
    """world size -> state/peak bytes per rank (scenarios table, else the memory table's max over ranks)."""
    d = rows[["scenario", "world_size"]].copy()
    for col, cat in (("state_bytes", "state_total"), ("peak_bytes", "peak")):
        vals = rows[col] if col in rows else pd.Series(np.nan, index=rows.index)
        if len(mem) and vals.isna().any():
            m = rank_bytes(mem, cat)
            vals = vals.fillna(rows["scenario"].map(m.groupby(level="scenario").max() if len(m) else {}))
        d[col] = vals.astype(float)
    return d
