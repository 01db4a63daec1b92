"""The localiser after a run: the first N scenarios with a failing numeric verdict, each replayed with its
yardstick (harness.localize.replay), their chains in the "localised" table and in those verdicts' messages."""

from __future__ import annotations

import dataclasses

import pandas as pd

from harness.core.scenario import REFERENCE_IMPL
from harness.core.verdict import FAIL
from harness.execute.world import WorldPool
from harness.localize.replay import replay_or_why
from harness.localize.replayed import REPLAYED
from harness.options import DEFAULT_LOCALIZE
from harness.tables.schema import columns

# the verdicts that compare numbers with a yardstick: a failure of any of them is localised
LOCALISED_CHECKS = (
    "finite",
    "ws1_exact",
    "cross_ws_replicated",
    "grads_match_ws1",
    "split_matches_full_batch",
    "grad_norm_matches",
    "clip_acts",
    "ckpt_restored",
    "replicas_agree",
    "factorisations_agree",
    "converges",
    "jitter_invariant",
)


def to_localise(result, n: int) -> list:
    """The first `n` scenarios (in the verdicts' order) with a failing numeric verdict, the plain model's own
    runs left out (nothing to localise them against)."""
    by_id = {s.id: s for s in result.scenarios}
    # a split crossing the run already replayed (harness.localize.replayed) names where it parted: not again
    replayed = {v.scenario for v in result.verdicts if REPLAYED in v.message}
    chosen = []
    for v in result.verdicts:
        sc = by_id.get(v.scenario)
        if (
            v.status == FAIL
            and v.check in LOCALISED_CHECKS
            and sc is not None
            and sc.impl != REFERENCE_IMPL
            and sc not in chosen
            and v.scenario not in replayed
        ):
            chosen.append(sc)
    return chosen[:n]


def localise_failures(result, n: int = DEFAULT_LOCALIZE, *, pool: WorldPool, say=lambda line: None) -> None:
    """Localise up to `n` failing scenarios of `result` (a harness.phases.RunResult) in place, in `pool`'s worlds:
    the "localised" table, and the chain's one-line form appended to each failing verdict of those scenarios."""
    chosen = to_localise(result, n)
    if not chosen:
        return
    say(f"localising {len(chosen)} failing scenario(s): each replayed with its yardstick, every op traced")
    rows, lines = [], {}
    for sc in chosen:
        found, why = replay_or_why(sc, pool=pool)
        if found is None:  # the run itself stays judged: the localisation says why it could not
            rows.append({"scenario": sc.id, "element": f"could not be localised: {why}"})
            lines[sc.id] = f"could not be localised ({why})"
            continue
        rows.append(row_of(found))
        lines[sc.id] = found.short()
        say(f"  {sc.id}: {found.short()}")
    result.tables["localised"] = pd.DataFrame(rows, columns=columns("localised"))
    failing = {v.scenario for v in result.verdicts if v.status == FAIL and v.check in LOCALISED_CHECKS}
    result.verdicts[:] = [
        dataclasses.replace(v, message=f"{v.message.rstrip('. ')}. Where it diverged: {lines[v.scenario]}")
        if v.scenario in lines and v.scenario in failing and v.status == FAIL and v.check in LOCALISED_CHECKS
        else v
        for v in result.verdicts
    ]


def row_of(found) -> dict:
    p = found.point
    base = {
        "scenario": found.scenario.id,
        "yardstick": found.yardstick.id,
        "steps": f"{found.steps[0]}-{found.steps[-1]}",
    }
    if p is None:
        return {**base, "element": "no divergence: every traced op and state matches the yardstick bit for bit"}
    return {
        **base,
        "step": p.step,
        "micro_batch": p.pass_,
        "phase": p.phase,
        "module": p.module,
        "op": p.op,
        "ranks": ",".join(map(str, p.ranks)),
        "element": p.detail,
        "rounding": bool(p.rounding),
        "context": "\n".join("\t".join(row) for row in p.context),
    }
