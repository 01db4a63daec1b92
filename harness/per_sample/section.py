"""The report's "Per-sample gradient norms" section, from the tables that
``harness.per_sample.run.run_per_sample`` returns: "per_sample_summary" (one row per model x impl x
data mode x world size) and "per_sample" (one row per sample), plus the run's verdicts. The package
registers it with the report when imported (harness/per_sample/__init__.py)."""

from __future__ import annotations

import pandas as pd

from harness.core.verdict import PASS, SKIP
from harness.report.formatting import md_table, num
from harness.report.groups import table_or_empty

MAX_SAMPLES = 8
NEGATIVE_CONTROL = "allreduce"
CONTROL_CHECK = "per_sample_norms_negative_control"
IMPL_ORDER = {"fsdp_impl": 0, "allreduce": 1, "opacus": 2}
INTRO = (
    "Norm of each sample's loss gradient |grad l_i| (the DP-SGD convention), against a float64 "
    "single-process truth (`torch.func` vmap of grad). *ratio of means* = impl mean norm / truth mean norm "
    "(1 when right; about sqrt(W) when per-sample norms are summed over ranks); *max rel err* is over every "
    "sample and rank; *clipped update rel err* = max |update - exact clipped-mean update| / its largest "
    "entry after one SGD step (clip at the median truth norm, lr 1); *|update|/|exact|* = ratio of 2-norms."
)
CONTROL_NOTE = (
    "`allreduce` is a **negative control**, not a product: the known-bad aggregation (per-sample norms "
    "all-reduced position by position over ranks). It is run to show the check catches that bug; its "
    "verdict `per_sample_norms_negative_control` PASSES when the bug is detected (at W=1 there is "
    "nothing to detect: skipped)."
)


def _impl_key(col: pd.Series) -> pd.Series:
    return col.map(IMPL_ORDER).fillna(9) if col.name == "impl" else col


def _verdict_cells(verdicts: pd.DataFrame, ids: list[str]) -> list[str]:
    if not len(verdicts):
        return ["—"] * len(ids)
    by = verdicts.groupby("scenario")
    out = []
    for sid in ids:
        v = by.get_group(sid) if sid in by.groups else verdicts.iloc[:0]
        out.append(", ".join(f"{c} {s.upper()}" for c, s in zip(v["check"], v["status"])) or "—")
    return out


def _sample_table(ps: pd.DataFrame, model: str) -> pd.DataFrame:
    """sample | truth | one column per impl/mode/W, first MAX_SAMPLES samples of one model."""
    d = ps[(ps["model"] == model) & (ps["sample"] < MAX_SAMPLES)]
    d = d.sort_values(["impl", "data_mode", "world_size", "sample"], key=_impl_key, kind="stable")
    d = d.assign(col=[f"{i}/{m}/W={w}" for i, m, w in zip(d["impl"], d["data_mode"], d["world_size"])])
    wide = d.pivot_table(index="sample", columns="col", values="norm", aggfunc="first", sort=False)
    truth = d.groupby("sample")["truth"].first()
    table = pd.DataFrame({"sample": wide.index.astype(int), "truth": [num(x, ".7g") for x in truth.loc[wide.index]]})
    for c in wide.columns:
        table[c] = [num(x, ".7g") for x in wide[c]]
    return table


def _findings(verdicts: pd.DataFrame, summary: pd.DataFrame, ids: list[str]) -> list[str]:
    """Negative-control detections in one line; every other non-pass verdict of these impls (Opacus
    scenarios that produced no rows included) with its message."""
    if not len(verdicts):
        return []
    impl = verdicts["scenario"].astype(str).str.split("-").str[0]
    mine = verdicts[verdicts["scenario"].isin(ids) | impl.isin(list(IMPL_ORDER))].fillna({"message": ""})
    control = mine["check"] == CONTROL_CHECK
    caught = mine[control & (mine["status"] == PASS)]
    out = []
    if len(caught):
        ratios = dict(zip(ids, summary["ratio_of_means"]))
        shown = ", ".join(f"{sc.split('-', 1)[1]}: {ratios.get(sc, float('nan')):.3f}" for sc in caught["scenario"])
        out.append(
            f"- **Negative control: bug detected** by `per_sample_norms` in {len(caught)} of "
            f"{int((control & (mine['status'] != SKIP)).sum())} scenarios (ratio of means {shown})."
        )
    rest = mine[(mine["status"] != PASS) & ~(control & (mine["status"] == SKIP))]
    for (sc, st, m), g in rest.groupby(["scenario", "status", "message"], sort=False):  # same cause: one line
        out.append(f"- **{st.upper()}** {', '.join(f'`{c}`' for c in g['check'])} on `{sc}`: {m}")
    return ["Findings:", ""] + out + [""] if out else []


def per_sample_section(tables: dict) -> list[str]:
    """Markdown lines; empty when the run has no "per_sample_summary" table."""
    from harness.core.scenario import scenario_id

    summary = table_or_empty(tables, "per_sample_summary")
    if not len(summary):
        return []
    verdicts, samples = table_or_empty(tables, "verdicts"), table_or_empty(tables, "per_sample")
    summary = summary.sort_values(["model", "impl", "data_mode", "world_size"], key=_impl_key, kind="stable")
    ids = [
        scenario_id(i, m, int(w), d)
        for i, m, w, d in zip(summary["impl"], summary["model"], summary["world_size"], summary["data_mode"])
    ]
    out = ["## Per-sample gradient norms", "", INTRO, ""]
    if (summary["impl"] == NEGATIVE_CONTROL).any():
        out += [CONTROL_NOTE, ""]
    label = [f"{i} (negative control)" if i == NEGATIVE_CONTROL else i for i in summary["impl"]]
    out += [
        md_table(
            pd.DataFrame(
                {
                    "model": summary["model"],
                    "impl": label,
                    "mode": summary["data_mode"],
                    "W": summary["world_size"].astype(int),
                    "mean norm": [num(x, ".7g") for x in summary["mean_norm"]],
                    "truth mean": [num(x, ".7g") for x in summary["truth_mean"]],
                    "ratio of means": [num(x, ".7f") for x in summary["ratio_of_means"]],
                    "max rel err": [num(x) for x in summary["max_rel_err"]],
                    "clipped update rel err": [num(x) for x in summary["clipped_update_rel_err"]],
                    "|update|/|exact|": [num(x, ".4f") for x in summary["update_ratio"]],
                    "verdicts": _verdict_cells(verdicts, ids),
                }
            )
        ),
        "",
    ]
    out += _findings(verdicts, summary, ids)
    if len(samples):
        model = str(summary["model"].iloc[0])
        n = int(samples.loc[samples["model"] == model, "sample"].nunique())
        shown = f"first {MAX_SAMPLES} of {n} samples" if n > MAX_SAMPLES else f"all {n} samples"
        out += [
            f"### Per-sample norms: {model} ({shown}; columns impl/mode/W)",
            "",
            md_table(_sample_table(samples, model)),
            "",
        ]
    return out
