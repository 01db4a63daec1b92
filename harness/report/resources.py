"""The report's memory and communication sections: bytes per rank by category and world size (with
the ideal where the tables hold it), and the collectives of one training step on rank 0."""

from __future__ import annotations

import numpy as np
import pandas as pd

from harness.measure.timeline import ALLOWED, PHASES
from harness.report import plots
from harness.report.drawing import Plots
from harness.report.formatting import human_bytes, md_table, num
from harness.report.groups import cells_of, file_stem, group_label, groups_of, per_world_size, table_or_empty
from harness.tables.store import rank_bytes

MEM_ORDER = [
    "params",
    "grads",
    "optimizer_state",
    "state_params",
    "state_grads",
    "state_optimizer_state",
    "state_buffers",
    "state_other",
    "state_unattributed",
    "state_total",
    "activations",
    "other",
    "peak",
]


def memory_section(tables: dict, drawn: Plots) -> list[str]:
    cells, mem = cells_of(tables), table_or_empty(tables, "memory")
    out = [
        "## Memory",
        "",
        "Bytes per rank (max over ranks) by category and world size."
        + (" Cells read `measured (ideal)`." if "ideal_bytes" in mem else "")
        + " `state_*` is what the rank holds after the measured step, found from the rank process (every tensor"
        " storage reachable from Python that was not alive before the model was built; on CUDA also what the"
        " allocator holds beyond that): `state_total` is parameters + gradients + optimizer state, and"
        " `state_other` what is held outside them and the buffers. The other rows are the breakdown at the"
        " step's peak.",
        "",
    ]
    groups = groups_of(cells)
    if not groups or (not len(mem) and "state_bytes" not in cells):
        return out + ["_Memory: not measured._", ""]
    for key, rows in groups:
        out += [f"### {group_label(key)}", ""]
        m = mem[mem["scenario"].isin(rows["scenario"])] if len(mem) else mem
        if len(m):
            m = m.merge(rows[["scenario", "world_size"]], on="scenario")
            agg = {"bytes": "max", **({"ideal_bytes": "max"} if "ideal_bytes" in m else {})}
            cat = m.groupby(["category", "world_size"]).agg(agg)
            cell = cat.apply(
                lambda r: (
                    human_bytes(r["bytes"]) + (f" ({human_bytes(r['ideal_bytes'])})" if "ideal_bytes" in r else "")
                ),
                axis=1,
            )
            table = cell.unstack("world_size")
            order = [c for c in MEM_ORDER if c in table.index] + sorted(set(table.index) - set(MEM_ORDER))
            table = table.loc[order]
            st = rank_bytes(m, "state_total").rename("bytes").reset_index().merge(rows[["scenario", "world_size"]])
            if len(st):
                by = st.groupby("world_size")["bytes"]
                table.loc["rank balance (state max/min)"] = (by.max() / by.min()).map(lambda x: f"{x:.2f}")
            table.columns = [f"W={c}" for c in table.columns]
            out += [md_table(table.rename_axis("category").reset_index()), ""]
        else:
            out += ["_Per-category breakdown: not measured._", ""]
        out += _gathered_table(tables, rows)
        per_ws = per_world_size(rows, mem)
        if per_ws[["state_bytes", "peak_bytes"]].notna().any().any():
            out += [
                drawn.link(
                    plots.plot_memory,
                    f"memory-{file_stem(key)}{plots.SUFFIX}",
                    f"memory {group_label(key)}",
                    per_ws,
                    f"memory per rank: {group_label(key)}",
                ),
                "",
            ]
    return out


def _gathered_table(tables: dict, rows: pd.DataFrame) -> list[str]:
    """Units holding their full parameters at once, the most at one moment of each phase (max over
    ranks), by world size; a `+ root` where the root's own parameters were full too."""
    g = table_or_empty(tables, "gathered")
    if not len(g):
        return []
    g = g.merge(rows[["scenario", "world_size"]], on="scenario")
    g = g[g.world_size > 1]
    if not len(g):
        return []
    by = g.groupby(["phase", "world_size"]).agg(units=("units", "max"), root=("root", "any"))
    cell = by.apply(lambda r: f"{int(r['units'])}" + (" + root" if r["root"] else ""), axis=1).unstack("world_size")
    seen = [p for p in PHASES if p in cell.index]  # the eval phases only where a scenario evaluated
    cell = cell.loc[seen]
    cell.columns = [f"W={c}" for c in cell.columns]
    cell.index = [p.replace("_", " ") for p in cell.index]
    allowed = ", ".join(f"{p.replace('_', ' ')} {ALLOWED[p]}" for p in seen)
    root = "until backward ends" + (" and during the eval forward" if "eval" in seen else "")
    return [
        f"Units holding their full parameters at once, the most at one moment of each phase (ZeRO-3 allows "
        f"{allowed}; the root {root}):",
        "",
        md_table(cell.rename_axis("phase").reset_index()),
        "",
    ]


def comm_section(tables: dict) -> list[str]:
    comm, cells = table_or_empty(tables, "comm"), cells_of(tables)
    out = [
        "## Communication",
        "",
        "Per training step on rank 0, per collective and element type, in elements "
        "and bytes of the full size each collective handles. ZeRO-3 ideal: 2 all-gathers and 1 reduce-scatter "
        "of the parameters per step, (W-1)/W of their bytes each on the wire.",
        "",
    ]
    if not len(comm) or not len(cells):
        return out + ["_Communication: not measured._", ""]
    for key, rows in groups_of(cells):
        c = comm.merge(rows[["scenario", "world_size"]], on="scenario").sort_values(["world_size", "collective"])
        out += [f"### {group_label(key)}", ""]
        if not len(c):
            out += ["_No collectives recorded._", ""]
            continue
        col = lambda name: c[name] if name in c else pd.Series(np.nan, index=c.index)  # noqa: E731
        t = pd.DataFrame(
            {
                "world size": c["world_size"],
                "collective": c["collective"],
                "dtype": col("dtype").fillna("").astype(str),
                "group ranks": [num(x, "g") for x in col("ranks")],
                "calls per step": [num(x, "g") for x in c["calls"]],
                "elements per step": [num(x, ",.0f" if float(x).is_integer() else ",.6g") for x in col("elements")],
                "bytes per step": [human_bytes(x) for x in c["bytes"]],
                "bytes (exact)": [num(x, ".0f" if float(x).is_integer() else ".6g") for x in c["bytes"]],
            }
        )
        if "ideal_bytes" in c:
            t["ideal bytes"] = [human_bytes(x) for x in c["ideal_bytes"]]
        missing = sorted(set(rows["world_size"]) - set(c["world_size"]))
        out += [md_table(t), ""] + ([f"No collectives at W={', '.join(map(str, missing))}.", ""] if missing else [])
    return out
