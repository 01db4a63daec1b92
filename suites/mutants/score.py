"""Run the mutant catalogue and score the harness: which checks catch which injected fault, where.

    python -m suites.mutants.score [--only NAME,...] [--out reports/mutation_score.md]

All mutants and controls run in ONE ``run_matrix`` call (one WorldPool: a world per world size,
reused by every adapter); per-sample mutants run their world task in the same pool afterwards.
``score_table()`` gives the table the main report can include.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.models import MODELS
from harness.scenario import REFERENCE_IMPL, Scenario, build_matrix
from harness.verdict import FAIL, Verdict
from suites.mutants.catalog import CATALOGUE, CONTROLS, PROPOSED_CHECKS, Mutant

DEFAULT_OUT = Path("reports/mutation_score.md")
PROPOSED_NAMES = {c.__name__ for c in PROPOSED_CHECKS}
PER_SAMPLE_BATCH = 16
PER_SAMPLE_STEP = 1


def models_of(m: Mutant) -> tuple[str, ...]:
    """The models a mutant runs on: its exposing models, or its stand-in while none is in the zoo."""
    present = tuple(x for x in m.models if x in MODELS)
    return present or ((m.stand_in,) if m.stand_in else ())


def open_gap(m: Mutant) -> str:
    """Why the harness cannot catch `m` today ("" if it should): a missing check, or a missing model
    (that gap closes by itself once one of the mutant's exposing models is in the zoo)."""
    if not m.gap:
        return ""
    if m.stand_in:
        return m.gap if models_of(m) == (m.stand_in,) else ""
    return m.gap


def scenarios_of(m: Mutant, seed: int = 0) -> list[Scenario]:
    """The mutant's own cells (no reference runs)."""
    if m.kind == "per_sample":
        return []
    cells = build_matrix([m.spec], list(models_of(m)), list(m.world_sizes), list(m.data_modes),
                         list(m.optimizers), steps=m.steps, seeds=(seed,))
    return [c for c in cells if c.impl != REFERENCE_IMPL]


def control_scenarios(mutants, seed: int = 0) -> list[Scenario]:
    """Every control adapter in every (model, W, mode, optimizer, steps) cell some mutant runs in."""
    shapes = sorted({(c.model, c.world_size, c.data_mode, c.optimizer, c.steps)
                     for m in mutants for c in scenarios_of(m, seed)})
    return [Scenario(impl, model, ws, mode, opt, steps=steps, seed=seed)
            for impl, _ in CONTROLS for model, ws, mode, opt, steps in shapes]


@dataclass
class MutantResult:
    mutant: Mutant
    scenarios: list[str]
    verdicts: list[Verdict]  # harness verdicts about the mutant's scenarios (or per-sample checks)
    proposed: list[Verdict] = field(default_factory=list)  # PROPOSED_CHECKS on the same scenarios

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.status == FAIL]

    @property
    def caught_by(self) -> dict[str, int]:
        """check -> number of the mutant's scenarios it failed."""
        out: dict[str, int] = {}
        for v in self.failed:
            out[v.check] = out.get(v.check, 0) + 1
        return dict(sorted(out.items()))

    @property
    def expected_failures(self) -> list[Verdict]:
        pool = self.verdicts + self.proposed
        return [v for v in pool if v.check == self.mutant.expected and v.status == FAIL]

    @property
    def caught(self) -> bool:
        """Caught by the harness as it is: the expected check, a harness check, failed somewhere."""
        return any(v.check == self.mutant.expected for v in self.failed)

    @property
    def caught_by_proposal(self) -> bool:
        return any(v.check == self.mutant.expected and v.status == FAIL for v in self.proposed)

    @property
    def where(self) -> str:
        hits = self.expected_failures
        if not hits:
            return ""
        first = min(hits, key=lambda v: _step_of(v.where))
        return f"{first.scenario}: {first.where}"


def _step_of(where: str) -> float:
    if where.startswith("step "):
        try:
            return int(where.split(",")[0].split()[1])
        except (IndexError, ValueError):
            pass
    return math.inf


@dataclass
class CatalogueRun:
    results: dict[str, MutantResult]
    controls: list[Verdict]  # verdicts about the reference runs and the control adapters
    wall_s: float
    run: object = None  # the RunResult of the matrix


def run_catalogue(mutants=CATALOGUE, *, seed: int = 0, pool=None, progress=None) -> CatalogueRun:
    """Run every mutant (and the controls) in one matrix; then the per-sample mutants."""
    from harness.run import run_matrix
    from harness.world import WorldPool

    t0 = time.perf_counter()
    mutants = list(mutants)
    own = {m.name: scenarios_of(m, seed) for m in mutants}
    cells = [c for m in mutants for c in own[m.name]] + control_scenarios(mutants, seed)
    refs = sorted({c.reference() for c in cells}, key=lambda s: s.id)
    own_pool = pool is None
    pool = pool or WorldPool()
    try:
        res = run_matrix(refs + cells, pool=pool, progress=progress) if cells else None
        proposed = [v for check in PROPOSED_CHECKS for v in check(res.tables)] if res else []
        results, per_sample_controls = {}, []
        for m in mutants:
            ids = {c.id for c in own[m.name]}
            if m.kind == "per_sample":
                verdicts, control = _run_per_sample(m, pool, seed)
                results[m.name] = MutantResult(m, sorted({v.scenario for v in verdicts}), verdicts)
                per_sample_controls += control
            else:
                results[m.name] = MutantResult(
                    m, sorted(ids), [v for v in res.verdicts if v.scenario in ids],
                    [v for v in proposed if v.scenario in ids])
        mutant_ids = {i for r in results.values() for i in r.scenarios}
        controls = [v for v in (res.verdicts if res else []) if v.scenario and v.scenario not in mutant_ids]
        controls += [v for v in proposed if v.scenario not in mutant_ids]
        controls += per_sample_controls
    finally:
        if own_pool:
            pool.close()
    return CatalogueRun(results, controls, time.perf_counter() - t0, res)


def _run_per_sample(m: Mutant, pool, seed: int) -> tuple[list[Verdict], list[Verdict]]:
    """(verdicts about the mutant's norms, verdicts about the product's norms) per (W, data mode)."""
    from harness.per_sample import check_per_sample_norms, truth

    mutant, control = [], []
    for model in models_of(m):
        t = truth(model, seed, PER_SAMPLE_BATCH, PER_SAMPLE_STEP)
        for ws in m.world_sizes:
            for mode in m.data_modes:
                payload = {"model": model, "seed": seed, "batch": PER_SAMPLE_BATCH, "step": PER_SAMPLE_STEP,
                           "mode": mode}
                ranks = pool.get(ws, "gloo").run(m.spec, payload)
                for variant, out in (("mutant", mutant), ("control", control)):
                    sid = f"{m.name if variant == 'mutant' else 'fsdp_impl'}-{model}-ws{ws}-{mode}"
                    out.append(check_per_sample_norms(sid, [r["norms"][variant] for r in ranks], t.norms))
    return mutant, control


# ---------------------------------------------------------------------------------- the score

def _caught_cell(r: MutantResult) -> str:
    if r.caught:
        return "yes"
    if r.caught_by_proposal:
        return "no (caught by the proposed check)"
    if r.mutant.stand_in and models_of(r.mutant) == (r.mutant.stand_in,):
        return f"no (no model in the zoo exposes it; ran on {r.mutant.stand_in})"
    return "no"


def score_table(run: CatalogueRun | None = None) -> pd.DataFrame:
    """One row per mutant: mutant | models what | expected check | caught by | where | caught?."""
    run = run or run_catalogue()
    rows = []
    for r in run.results.values():
        m = r.mutant
        by = ", ".join(f"{c} ({n}/{len(r.scenarios)})" for c, n in r.caught_by.items()) or "nothing"
        expected = m.expected + (" (proposed)" if m.expected in PROPOSED_NAMES else "")
        rows.append({"mutant": m.name, "models what": m.what, "expected check": expected, "caught by": by,
                     "where": r.where or "-", "caught?": _caught_cell(r)})
    return pd.DataFrame(rows, columns=["mutant", "models what", "expected check", "caught by", "where", "caught?"])


def render(run: CatalogueRun) -> str:
    table = score_table(run)
    n, caught = len(run.results), sum(r.caught for r in run.results.values())
    proposal = sum(r.caught or r.caught_by_proposal for r in run.results.values())
    gaps = [r.mutant for r in run.results.values() if not r.caught]
    bad_controls = [v for v in run.controls if v.status == FAIL]
    lines = [
        "# Mutation score", "",
        f"**{caught}/{n} mutants caught** by the harness's checks ({caught / n:.0%}); "
        f"{proposal}/{n} with the proposed checks. Run time {run.wall_s:.0f} s.", "",
        "Each mutant is fsdp_impl with one injected fault (suites/mutants/catalog.py), run in the matrix "
        "that should expose it; `caught by` counts the mutant's scenarios each check failed, `where` is "
        "the earliest failure of the expected check.", "",
        table.to_markdown(index=False), "",
    ]
    if gaps:
        lines += ["## Gaps (escaped mutants and the change that catches them)", ""]
        lines += [f"- **{m.name}**: {open_gap(m) or 'UNEXPECTED escape: no gap is recorded for it'}" for m in gaps]
        lines.append("")
    lines += ["## Controls", "",
              f"{len({v.scenario for v in run.controls})} unmutated scenarios (the reference and "
              f"{', '.join(c for c, _ in CONTROLS)}) in the same cells: "
              + ("no check failed." if not bad_controls else f"{len(bad_controls)} FAILED:")]
    lines += [f"- {v}" for v in bad_controls]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m suites.mutants.score", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma list of mutant names (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report path (default {DEFAULT_OUT})")
    p.add_argument("--quiet", action="store_true")
    ns = p.parse_args(argv)
    names = [n for n in ns.only.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in CATALOGUE})
    if unknown:
        p.error(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(m.name for m in CATALOGUE)}")
    mutants = [m for m in CATALOGUE if not names or m.name in names]
    progress = None if ns.quiet else (
        lambda i, n, sc, s: sys.stderr.write(f"[mutants] {i:>3}/{n} {sc.id:<64} {s:5.1f}s\n"))
    run = run_catalogue(mutants, progress=progress)
    path = write_atomic(ns.out, render(run))
    caught = sum(r.caught for r in run.results.values())
    sys.stderr.write(f"{caught}/{len(run.results)} mutants caught; report: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
