"""The report's "Batch-invariant tier" section, from the "invariant" table (harness.invariant.run) and the
run's verdicts of its checks."""

from __future__ import annotations

import pandas as pd

from harness.report.formatting import md_table

INTRO = (
    "Implementations that declare themselves batch-invariant trained through their own invariant step "
    "(`invariant_forward_backward`: L micro-batches of the global batch, each loss / L, the gradients summed in "
    "one fixed binary tree over the micro-batch index) at every world size, split and replicated data, and "
    "held at **bound 0**: `invariant_matches_tree` against the plain model summing the same micro-batches in "
    "the same tree at one rank, `invariant_across_ws` against the same implementation at the smallest world "
    "size, `invariant_ranks_agree` on every rank's loss. The figures are the largest |parameter difference| "
    "over every step and parameter (0 = bitwise)."
)


def invariant_section(tables: dict) -> list[str]:
    table = tables.get("invariant")
    if not isinstance(table, pd.DataFrame) or not len(table):
        return []
    verdicts = tables.get("verdicts")
    status = {}
    if isinstance(verdicts, pd.DataFrame) and len(verdicts):
        mine = verdicts[verdicts["check"].astype(str).str.startswith("invariant_")]
        for s, g in mine.groupby("scenario"):
            status[s] = ", ".join(f"{c} {v.upper()}" for c, v in zip(g["check"], g["status"]))
    per = (
        table.groupby(["scenario", "impl", "model", "feature", "world_size", "data_mode", "optimizer"], sort=False)
        .agg(steps=("step", "max"), tree=("diff_tree", "max"), ws_min=("diff_ws_min", "max"))
        .reset_index()
    )
    rows = [
        {
            "implementation": r.impl,
            "model": r.model,
            "feature": r.feature,
            "W": int(r.world_size),
            "data": r.data_mode,
            "optimizer": r.optimizer,
            "steps": int(r.steps),
            "max diff vs tree reference": f"{r.tree:.3g}",
            "max diff vs smallest W": f"{r.ws_min:.3g}",
            "verdicts": status.get(r.scenario, "—"),
        }
        for r in per.itertuples()
    ]
    zero = sum(r["max diff vs tree reference"] == "0" and r["max diff vs smallest W"] == "0" for r in rows)
    return [
        "## Batch-invariant tier",
        "",
        INTRO,
        "",
        f"**{zero}/{len(rows)} runs bitwise** equal to the tree reference and to the smallest world size.",
        "",
        md_table(pd.DataFrame(rows)),
        "",
    ]
