"""python -m harness.invariant [--impl fsdp_impl] [--models mlp,tinylm,tinylm_tied] [--world-sizes 1,2,4,8]
[--features plain,bf16,ac,clip_inf,ckpt] [--optimizers adamw,sgd] [--steps 4] [--seeds 0] [--out reports/invariant.md]

The batch-invariant tier alone (without the equivalence matrix that ``python -m harness run --invariant`` runs
first): its report section and verdict counts written to --out; exit 1 if any verdict failed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import options as opt


def main(argv=None) -> int:
    from harness.invariant.task import FEATURES

    p = argparse.ArgumentParser(prog="python -m harness.invariant", description=__doc__.splitlines()[0])
    p.add_argument("--impl", type=lambda t: tuple(x for x in t.split(",") if x), default=("fsdp_impl",))
    p.add_argument("--models", type=opt.models, default=opt.DEFAULT_MODELS)
    p.add_argument("--world-sizes", type=opt.world_sizes, default=(1, 2, 4, 8))
    p.add_argument("--optimizers", type=lambda t: tuple(x for x in t.split(",") if x), default=("adamw", "sgd"))
    p.add_argument("--features", type=lambda t: tuple(x for x in t.split(",") if x), default=FEATURES)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seeds", type=opt.seeds, default=(0,), help="comma list; the tier runs under each (default 0)")
    p.add_argument("--out", type=Path, default=Path("reports/invariant.md"))
    ns = p.parse_args(argv)
    bad = [f for f in ns.features if f not in FEATURES]
    if bad:
        p.error(f"the tier runs {', '.join(FEATURES)}, not {', '.join(bad)}")
    import pandas as pd

    from harness.checks.registry import verdict_table
    from harness.core.scenario import DATA_MODES
    from harness.invariant.run import run_invariant
    from harness.invariant.section import invariant_section
    from harness.tables.store import write_text_atomic

    tables, verdicts = {"invariant": []}, []
    for seed in ns.seeds:
        got, judged = run_invariant(
            ns.impl,
            ns.models,
            ns.world_sizes,
            DATA_MODES,
            ns.optimizers,
            steps=ns.steps,
            features=ns.features,
            seed=seed,
            progress=lambda s: sys.stderr.write(f"[invariant] {s}\n"),
        )
        tables["invariant"].append(got["invariant"])
        verdicts += judged
    tables["invariant"] = pd.concat(tables["invariant"], ignore_index=True)
    counts = {s: sum(v.status == s for v in verdicts) for s in ("pass", "fail", "unsupported")}
    command = "python -m harness.invariant " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"<!-- {command.strip()} -->",
        *invariant_section({**tables, "verdicts": verdict_table(verdicts)}),
        f"Verdicts: {counts['pass']} passed, {counts['fail']} failed, {counts['unsupported']} unsupported.",
        "",
    ]
    lines += [f"- {v}" for v in verdicts if v.status == "fail"]
    path = write_text_atomic(ns.out, "\n".join(lines) + "\n")
    sys.stderr.write(f"{counts['pass']} passed, {counts['fail']} failed; report: {path}\n")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
