"""The report's "Where it diverged" section, from the "localised" table (harness.localize.auto)."""

from __future__ import annotations

import math

import pandas as pd

from harness.report.formatting import md_table


def _given(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value)) and str(value) != ""


def where_it_diverged(tables: dict) -> list[str]:
    loc = tables.get("localised")
    if loc is None or not len(loc):
        return []
    lines = [
        "## Where it diverged",
        "",
        "Each scenario below failed a numeric check and was replayed with its yardstick (the plain model on "
        "the same batch; with split data, the ranks' slices as its micro-batches), every op traced on every "
        "rank, to the first point where they parted (`python -m harness localize SCENARIO_ID` does it for "
        "any scenario; `--localize N` sets how many a run does, 0 for none). *rounding only*: no more apart "
        "than summing the ranks' terms in another order gives.",
        "",
    ]
    for r in loc.itertuples():
        lines += [f"### {r.scenario}", ""]
        if not _given(getattr(r, "phase", None)):
            lines += [str(r.element), ""]
            continue
        chain = [("step", int(r.step))]
        if _given(r.micro_batch):
            chain.append(("micro-batch", int(r.micro_batch)))
        chain += [
            ("phase", str(r.phase) + (" (rounding only)" if bool(r.rounding) else "")),
            ("module", r.module),
            ("op", r.op),
            ("rank", r.ranks),
            ("element", r.element),
        ]
        lines += ["```", f"against {r.yardstick}, steps {r.steps}"] + [f"{k:<12} {v}" for k, v in chain] + ["```", ""]
        if _given(getattr(r, "context", None)):
            ops = [(line.split("\t") + ["", ""])[:3] for line in str(r.context).splitlines()]
            lines += [
                "The ops of that module around the point, side by side (the rank's: the ops that stood in the "
                "yardstick's place), and whether they agree bit for bit:",
                "",
                md_table(
                    pd.DataFrame(ops, columns=["yardstick op, output shape", "rank op, output shape", "bit for bit"])
                ),
                "",
            ]
    return lines
