"""Mutants that only a composition or a surface exposes (issue 25): each runs again where a single feature,
the zoo's usual models or the stock optimizers would put it, and must escape every check there.

A mutant that a single feature already catches does not show that the composition is needed. So for each
mutant below the score runs its *counterparts*: the same fault in the cells it would have without the
surface (each part of a composition alone, every other feature, the other models, the stock optimizers,
the smaller world sizes). The report's "Exposed only there" section shows, per mutant, what exposes it and
which checks failed in the counterparts: none, or the mutant is not composition-only (said as found,
with its cause, not hidden).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pandas as pd

from harness.core.features import FEATURES
from harness.core.scenario import REFERENCE_IMPL
from harness.core.verdict import FAIL, Verdict
from suites.mutants.catalog import CATALOGUE, Mutant

_SINGLE = tuple(f for f in FEATURES if f != "eval")

# mutant -> (what exposes it, the counterparts: changes to its catalogue cells, one Mutant each)
ONLY_THERE: dict[str, tuple[str, tuple[dict, ...]]] = {
    "held_in_param_dtype": ("the composition no_sync+bf16", ({"features": ("no_sync",)}, {"features": ("bf16",)})),
    "no_grad_forward_unsharded": ("the eval pass (a no_grad forward between steps)", ({"features": _SINGLE},)),
    "tail_before_last_dropped": (
        "tied_vocab33 at W = 8 (a short chunk on a rank before the last)",
        ({"world_sizes": (1, 2, 4)}, {"models": ("mlp", "tinylm", "tinylm_tied")}),
    ),
    "shard_normalised": (
        "a per-matrix optimizer (harness.train.optim:normalised_sgd)",
        ({"optimizers": ("adamw", "sgd")},),
    ),
    "gather_read_early": ("jitter (delays where asynchronous work races)", ({"features": ("plain",)},)),
    "offload_stale_host_copy": ("a CPU offload policy (feature offload)", ({"features": ("plain",)},)),
}


@dataclass
class Exposure:
    mutant: Mutant
    exposed_by: str
    counterparts: list[Mutant]
    verdicts: list[Verdict]  # about the counterparts' scenarios

    @property
    def failed(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts:
            if v.status == FAIL:
                out[v.check] = out.get(v.check, 0) + 1
        return dict(sorted(out.items()))


def counterparts(m: Mutant) -> list[Mutant]:
    return [dataclasses.replace(m, **change) for change in ONLY_THERE[m.name][1]]


def run_exposure(names: set[str], pool, seed: int = 0, progress=None) -> list[Exposure]:
    """The counterparts of every mutant of `names` that ONLY_THERE lists, in one matrix on `pool`."""
    from harness.phases import run_matrix
    from reports.mutation_score import scenarios_of

    chosen = [m for m in CATALOGUE if m.name in names and m.name in ONLY_THERE]
    if not chosen:
        return []
    own = {m.name: [s for c in counterparts(m) for s in scenarios_of(c, seed)] for m in chosen}
    cells = sorted({s for ss in own.values() for s in ss}, key=lambda s: s.id)
    refs = sorted({d for c in cells for d in c.dependencies() if d.impl == REFERENCE_IMPL}, key=lambda s: s.id)
    res = run_matrix(refs + cells, pool=pool, progress=progress)
    out = []
    for m in chosen:
        ids = {s.id for s in own[m.name]}
        out.append(Exposure(m, ONLY_THERE[m.name][0], counterparts(m), [v for v in res.verdicts if v.scenario in ids]))
    return out


def section(exposures: list[Exposure], results: dict) -> list[str]:
    """The report's "Exposed only there" section; `results`: the catalogue's MutantResult by name."""
    from reports.mutation_score import cells

    if not exposures:
        return []
    rows = []
    for e in exposures:
        r = results.get(e.mutant.name)
        failed = ", ".join(f"{c} ({n})" for c, n in e.failed.items()) or "none"
        rows.append(
            {
                "mutant": e.mutant.name,
                "exposed by": e.exposed_by,
                "caught there": "yes" if r is not None and r.caught else "**NO**",
                "counterpart cells": "; ".join(cells(c) for c in e.counterparts),
                "checks failed in the counterparts": failed,
                "only there?": "yes" if not e.failed else "**no**",
            }
        )
    only = sum(r["only there?"] == "yes" for r in rows)
    return [
        "## Exposed only there",
        "",
        f"**{only}/{len(rows)} composition and surface mutants are caught only where their surface is** "
        "(suites/mutants/exposure.py): each also ran in its counterpart cells, the ones it would have "
        "without the composition, feature, model, world size or optimizer that exposes it, and no check "
        "may fail there. A mutant that a counterpart catches is listed as such, with what caught it.",
        "",
        pd.DataFrame(rows).to_markdown(index=False),
        "",
    ]
