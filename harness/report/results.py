"""The report's results per world size: for each group of scenarios, one row per world size (final
loss, diffs, per-rank state and peak memory, step time), then the loss and the max |param diff|
vs reference per step, as tables and plots."""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.report import plots
from harness.report.drawing import Plots
from harness.report.formatting import human_bytes, md_table, missing, num, ratio
from harness.report.groups import (
    cells_of,
    file_stem,
    group_label,
    group_reference,
    groups_of,
    per_world_size,
    references_per_ws,
    table_or_empty,
)
from harness.report.verdicts import DIFF_COLUMN

MAX_STEP_ROWS = 25


def _pick_steps(steps: list, limit: int = MAX_STEP_ROWS) -> list:
    if len(steps) <= limit:
        return steps
    middle = np.linspace(10, len(steps) - 6, limit - 15).astype(int)
    idx = sorted({*range(10), *range(len(steps) - 5, len(steps)), *middle})
    return [steps[i] for i in idx]


def group_sections(tables: dict, drawn: Plots) -> list[str]:
    cells, steps, mem = cells_of(tables), table_or_empty(tables, "steps"), table_or_empty(tables, "memory")
    verdicts = table_or_empty(tables, "verdicts")
    out = ["## Results per world size", ""]
    groups = groups_of(cells)
    if not groups:
        return out + ["_Scenario results: not measured._", ""]
    for key, rows in groups:
        slug, label = file_stem(key), group_label(key)
        ref_id = group_reference(cells, key)
        said = f"Reference: `{ref_id or 'not run'}`."
        wider = references_per_ws(key, rows["world_size"])
        if wider:  # split data under bf16: each world size has its own (harness/core/policy.py, BF16_SPLIT)
            said = (
                f"Reference: `{ref_id or 'not run'}` at 1 rank; at W ranks the plain model summing the gradients "
                f"of the W ranks' micro-batches ({', '.join(f'`{r}`' for _, r in sorted(wider.items()))}); "
                f"the loss table's reference column is the first."
            )
        out += [f"### {label}", "", said, ""]
        mws = per_world_size(rows, mem)
        one = mws[mws["world_size"] == 1]
        s1, p1 = (one["state_bytes"].iloc[0], one["peak_bytes"].iloc[0]) if len(one) else (np.nan, np.nan)
        col = lambda c: rows[c] if c in rows else pd.Series(np.nan, index=rows.index)  # noqa: E731
        table = pd.DataFrame(
            {
                "world size": rows["world_size"].astype(int),
                "final loss": [num(x, ".10g") for x in col("final_loss")],
                "param sum": [num(x, ".10g") for x in col("param_sum")],
                "max diff vs 1 rank": [num(x) for x in col("max_diff_ws1")],
                "max diff vs reference": [num(x) for x in col("max_diff_ref")],
                "per-rank state": [human_bytes(x) for x in mws["state_bytes"]],
                "peak memory": [human_bytes(x) for x in mws["peak_bytes"]],
                "reduction vs 1 rank": [ratio(s1, x) for x in mws["state_bytes"]],
                "peak reduction": [ratio(p1, x) for x in mws["peak_bytes"]],
                "step time": [num(x, ".3f") + " s" if not missing(x) else "—" for x in col("step_time_s")],
            }
        )
        if "error" in rows and (rows["error"].fillna("").astype(str) != "").any():
            table["error"] = rows["error"].fillna("").astype(str).to_list()
        out += [md_table(table), ""]
        g = steps[steps["scenario"].isin(rows["scenario"])] if len(steps) else steps
        if not len(g):
            out += ["_Per-step losses and diffs: not measured._", ""]
            continue
        ref = steps[steps["scenario"] == ref_id] if ref_id else None
        # dropna=False: a step whose loss went NaN is a row to show, not one to drop
        loss = g.pivot_table(index="step", columns="world_size", values="loss", aggfunc="first", dropna=False)
        if ref is not None and len(ref):
            loss["reference"] = ref.set_index("step")["loss"]
        picked = _pick_steps(list(loss.index))
        show = loss.reindex(picked).map(lambda x: num(x, ".10g"))
        show.columns = [f"W={c}" if c != "reference" else c for c in show.columns]
        out += [
            "#### Loss per iteration",
            "",
            md_table(show.reset_index()),
            "",
            drawn.link(plots.plot_loss, f"loss-{slug}{plots.SUFFIX}", f"loss {label}", g, ref, f"loss: {label}"),
            "",
        ]
        diff = g.pivot_table(
            index="step", columns="world_size", values="max_diff_ref", aggfunc="first", dropna=False
        ).reindex(index=loss.index)
        show = diff.reindex(picked).map(num)
        show.columns = [f"W={c}" for c in show.columns]
        bounds = {}
        if len(verdicts):  # only the bounds held against this plot's quantity, |param diff| vs reference
            vb = verdicts[
                verdicts["scenario"].isin(rows["scenario"])
                & verdicts["check"].map(lambda c: DIFF_COLUMN.get(c) == "max_diff_ref")
            ]
            vb = vb.assign(bound=pd.to_numeric(vb["bound"], errors="coerce")).dropna(subset=["bound"])
            bounds = {c: float(b) for c, b in zip(vb["check"], vb["bound"]) if b > 0}
        out += [
            "#### Max |param diff| vs reference per step",
            "",
            md_table(show.reset_index()),
            "",
            drawn.link(
                plots.plot_diff,
                f"diff-{slug}{plots.SUFFIX}",
                f"param diff {label}",
                g,
                f"max |param diff| vs reference: {label}",
                bounds=bounds,
            ),
            "",
        ]
    return out
