"""The score report's "Batch-invariant tier" section: each fault of the invariant step
(suites/mutants/invariant_mutants.py) run through the tier, where it must be caught, and through the default
matrix's cells, where nothing may catch it (the default step never calls the invariant step): a mutant that the
matrix already catches would not show that the tier is needed."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.core.scenario import DATA_MODES, build_matrix
from harness.core.verdict import FAIL, Verdict

MODULE = "suites.mutants.invariant_mutants"
MUTANTS = {
    "tree_sequential": "each rank adds its micro-batches' gradients one after the other, not in the tree",
    "ranks_in_rank_order": "the tree's levels across ranks summed in rank order",
    "loss_per_rank": "each micro-batch's loss divided by the rank's L / W micro-batches, not by L",
}
MODELS = ("mlp", "tinylm_tied")


@dataclass
class InvariantMutant:
    name: str
    what: str
    tier: list[Verdict]
    matrix: list[Verdict]  # the default matrix's verdicts about the mutant's own scenarios

    @staticmethod
    def failed(verdicts: list[Verdict]) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in verdicts:
            if v.status == FAIL:
                out[v.check] = out.get(v.check, 0) + 1
        return dict(sorted(out.items()))

    @property
    def caught(self) -> bool:
        return bool(self.failed(self.tier))

    @property
    def only_there(self) -> bool:
        return not self.failed(self.matrix)


def run_invariant_mutants(pool, world_sizes=(1, 2, 4, 8), steps: int = 3) -> list[InvariantMutant]:
    from harness.invariant.run import run_invariant
    from harness.phases import run_matrix

    specs = {name: f"{MODULE}:{name}" for name in MUTANTS}
    cells = build_matrix(
        list(specs.values()), list(MODELS), [w for w in world_sizes if w <= 4], DATA_MODES, ("adamw",), steps=steps
    )
    matrix = run_matrix(cells, pool=pool)
    out = []
    for name, spec in specs.items():
        _, tier = run_invariant([spec], MODELS, world_sizes, DATA_MODES, ["adamw"], steps=steps, pool=pool)
        own = {c.id for c in cells if c.impl == spec}
        out.append(InvariantMutant(name, MUTANTS[name], tier, [v for v in matrix.verdicts if v.scenario in own]))
    return out


def section(results: list[InvariantMutant]) -> list[str]:
    if not results:
        return []
    rows = [
        {
            "mutant": r.name,
            "models what": r.what,
            "caught by the tier": ", ".join(f"{c} ({n})" for c, n in r.failed(r.tier).items()) or "**nothing**",
            "checks failed in the default matrix": ", ".join(f"{c} ({n})" for c, n in r.failed(r.matrix).items())
            or "none",
            "only there?": "yes" if r.caught and r.only_there else "**no**",
        }
        for r in results
    ]
    ok = sum(r["only there?"] == "yes" for r in rows)
    return [
        "## Batch-invariant tier",
        "",
        f"**{ok}/{len(rows)} faults of the invariant step are caught by the tier and by nothing in the default "
        f"matrix** (suites/mutants/invariant_score.py): each runs through the tier ({', '.join(MODELS)}, both "
        "data modes, AdamW, W up to 8, 3 steps; bound 0) and through the default matrix's cells (the same models "
        "at W up to 4), where the default step never calls the invariant step.",
        "",
        pd.DataFrame(rows).to_markdown(index=False),
        "",
    ]
