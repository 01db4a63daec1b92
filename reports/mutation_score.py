"""Run the mutant catalogue and score the harness: which checks catch which injected fault, where.

    python -m reports.mutation_score [--only NAME,...] [--false-alarm-seeds 0,1,2,3,4] [--out PATH]

All mutants and controls run in ONE ``run_matrix`` call (one WorldPool: a world per world size,
reused by every adapter); per-sample mutants run their world task in the same pool afterwards.
``--false-alarm-seeds`` then runs the correct implementations through the full default matrix
under each seed in the same pool (suites/mutants/false_alarms.py) and adds that table: a score
means something only next to the false alarms it costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from harness.core.scenario import REFERENCE_IMPL, Scenario, build_matrix
from harness.core.verdict import FAIL, Verdict
from harness.options import DEFAULT_WORLD_SIZES, positive_int
from harness.options import seeds as seed_list
from harness.tables.store import write_text_atomic
from suites.mutants import false_alarms as fa
from suites.mutants.catalog import CATALOGUE, CONTROL_CELLS, CONTROLS, Mutant, on_models
from suites.mutants.exposure import run_exposure
from suites.mutants.exposure import section as exposure_section
from suites.mutants.invariant_score import run_invariant_mutants
from suites.mutants.invariant_score import section as invariant_section

DEFAULT_OUT = Path("reports/mutation_score.md")
PER_SAMPLE_BATCH = 16
PER_SAMPLE_STEP = 1


def widened(m: Mutant) -> Mutant:
    """`m` at every default world size (per-sample mutants: every W > 1) and the full step count.
    Its own models, modes and optimizers stay: they are the ones that expose it (a tied or frozen
    model) or the ones where the reference itself is a valid yardstick (see catalog.py)."""
    sizes = [w for w in DEFAULT_WORLD_SIZES if w > 1 or m.kind != "per_sample"]
    return dataclasses.replace(m, world_sizes=tuple(sorted(set(m.world_sizes) | set(sizes))), steps=fa.FULL_STEPS)


def cells(m: Mutant) -> str:
    """The cells a mutant runs in, one line: models, world sizes, modes, optimizers, steps."""
    parts = [",".join(m.models), "W " + ",".join(map(str, m.world_sizes)), "/".join(m.data_modes)]
    if m.kind != "per_sample":
        parts += ["/".join(m.optimizers), f"{m.steps} steps"]
    if m.features != ("plain",):
        parts.append("/".join(m.features))
    return " · ".join(parts)


def scenarios_of(m: Mutant, seed: int = 0) -> list[Scenario]:
    """The mutant's own cells (no reference runs)."""
    if m.kind == "per_sample":
        return []
    cells = build_matrix(
        [m.spec],
        list(m.models),
        list(m.world_sizes),
        list(m.data_modes),
        list(m.optimizers),
        steps=m.steps,
        seeds=(seed,),
        features=m.features,
    )
    return [c for c in cells if c.impl != REFERENCE_IMPL]


def control_scenarios(mutants, seed: int = 0, designs_up_to: int | None = None) -> list[Scenario]:
    """Every control adapter in every (model, W, mode, optimizer, steps) cell some mutant runs in
    (those of CONTROL_CELLS in the cells it names). `designs_up_to`: the controls that are other correct
    designs (every one but fsdp_impl itself) only at world sizes up to it (the quick tier's 2: a design the
    checks accept at 1 and 2 ranks is accepted; larger worlds repeat it)."""
    shapes = sorted(
        {
            (c.model, c.world_size, c.data_mode, c.optimizer, c.steps, c.feature)
            for m in mutants
            for c in scenarios_of(m, seed)
        }
    )
    # in a feature's cells the product itself is the control; the other controls are about init,
    # reduction and optimizer wrappers, which the plain cells already hold
    return [
        Scenario(impl, model, ws, mode, opt, steps=steps, seed=seed, feature=feature)
        for impl, _ in CONTROLS
        for model, ws, mode, opt, steps, feature in shapes
        if feature == "plain" or impl == "fsdp_impl"
        if CONTROL_CELLS.get(impl, lambda *_: True)(model, ws)
        if impl == "fsdp_impl" or designs_up_to is None or ws <= designs_up_to
    ]


@dataclass
class MutantResult:
    mutant: Mutant
    scenarios: list[str]
    verdicts: list[Verdict]  # harness verdicts about the mutant's scenarios (or per-sample checks)

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
        return [v for v in self.failed if v.check == self.mutant.expected]

    @property
    def caught(self) -> bool:
        """The expected check failed in at least one of the mutant's scenarios."""
        return bool(self.expected_failures)

    @property
    def where(self) -> str:
        hits = self.expected_failures
        if not hits:
            return ""
        first = min(hits, key=lambda v: math.inf if v.step is None else v.step)
        return f"{first.scenario}: {first.location}"


@dataclass
class CatalogueRun:
    results: dict[str, MutantResult]
    controls: list[Verdict]  # verdicts about the reference runs and the control adapters
    wall_s: float
    run: object = None  # the RunResult of the matrix
    false_alarms: list = field(default_factory=list)  # false_alarms.FalseAlarmRun per seed
    localised: dict = field(default_factory=dict)  # mutant name -> harness.localize.replay.Localised, or an error
    exposure: list = field(default_factory=list)  # suites.mutants.exposure.Exposure per composition/surface mutant
    composition_alarms: list = field(default_factory=list)  # false_alarms.FalseAlarmRun of the CI compositions per seed
    invariant: list = field(default_factory=list)  # invariant_score.InvariantMutant per fault of the invariant step

    def control_failures(self) -> tuple[list[Verdict], list[Verdict]]:
        """The controls' failures, and apart from them the plain model's own limits (a BatchNorm under the bf16
        policy: no implementation involved, counted apart as the false-alarm tier counts them)."""
        impl_of = {s.id: s.impl for s in self.run.scenarios} if self.run is not None else {}
        limits = fa.model_limit_ids(self.controls, impl_of)
        failed = [v for v in self.controls if v.status == FAIL]
        return [v for v in failed if id(v) not in limits], [v for v in failed if id(v) in limits]


def run_catalogue(
    mutants=CATALOGUE,
    *,
    seed: int = 0,
    false_alarm_seeds=(),
    pool=None,
    progress=None,
    false_alarm_models=fa.DEFAULT_MODELS,
    localise: bool = False,
    exposure: bool = False,
    composition_seeds=(),
    sweep_dir: Path | None = None,
    sweep_jobs: int = 1,
    invariant: bool = False,
    designs_up_to: int | None = None,
) -> CatalogueRun:
    """Run every mutant (and the controls) in one matrix; then the per-sample mutants; then the
    correct implementations' full matrix on `false_alarm_models` under each of `false_alarm_seeds`;
    `localise`: each numeric mutant localised in its catalogue cell (suites/mutants/localised.py); `exposure`:
    the composition and surface mutants run in their counterpart cells too (suites/mutants/exposure.py);
    `composition_seeds`: the CI compositions on the correct implementations under each seed; `sweep_dir`: the
    false-alarm sweep saves each (seed, model) there as it finishes and reads back those already there; `sweep_jobs`:
    that many parts at a time, each in a process of its own (false_alarms.run_parts)."""
    from harness.execute.world import WorldPool
    from harness.phases import run_matrix

    t0 = time.perf_counter()
    mutants = list(mutants)
    own = {m.name: scenarios_of(m, seed) for m in mutants}
    cells = [c for m in mutants for c in own[m.name]] + control_scenarios(mutants, seed, designs_up_to)
    # the reference runs they are compared with: the plain model and, for split data, its noise probes
    refs = sorted({d for c in cells for d in c.dependencies() if d.impl == REFERENCE_IMPL}, key=lambda s: s.id)
    own_pool = pool is None
    pool = pool or WorldPool()
    try:
        res = run_matrix(refs + cells, pool=pool, progress=progress) if cells else None
        results, per_sample_controls = {}, []
        for m in mutants:
            ids = {c.id for c in own[m.name]}
            if m.kind == "per_sample":
                verdicts, control = _run_per_sample(m, pool, seed)
                results[m.name] = MutantResult(m, sorted({v.scenario for v in verdicts}), verdicts)
                per_sample_controls += control
            else:
                results[m.name] = MutantResult(m, sorted(ids), [v for v in res.verdicts if v.scenario in ids])
        mutant_ids = {i for r in results.values() for i in r.scenarios}
        controls = [v for v in (res.verdicts if res else []) if v.scenario and v.scenario not in mutant_ids]
        controls += per_sample_controls
        wall_s = time.perf_counter() - t0
        if sweep_dir is None:
            alarms = [
                fa.run_false_alarms(fa.full_matrix(s, false_alarm_models), seed=s, pool=pool, progress=progress)
                for s in false_alarm_seeds
            ]
        else:
            say = lambda line: sys.stderr.write(f"[false alarms] {line}\n")  # noqa: E731
            if sweep_jobs > 1:
                fa.run_parts(false_alarm_seeds, false_alarm_models, sweep_dir, sweep_jobs, log=say)
            alarms = [
                fa.run_saved(s, false_alarm_models, sweep_dir, pool=pool, progress=progress, log=say)
                for s in false_alarm_seeds
            ]
        located = localise_catalogue({m.name for m in mutants}, pool) if localise else {}
        exposed = run_exposure({m.name for m in mutants}, pool, seed, progress) if exposure else []
        composed = [
            fa.run_false_alarms(fa.composition_matrix(s), seed=s, pool=pool, progress=progress)
            for s in composition_seeds
        ]
        tier = run_invariant_mutants(pool) if invariant else []
    finally:
        if own_pool:
            pool.close()
    return CatalogueRun(results, controls, wall_s, res, alarms, located, exposed, composed, tier)


def localise_catalogue(names: set[str], pool) -> dict:
    """Each numeric mutant of `names` localised in its catalogue cell (its own models, whatever models the
    score ran it on: the expected modules are those of its cell)."""
    import tempfile
    from pathlib import Path

    from harness.localize.replay import replay
    from suites.mutants.localised import cell

    out = {}
    from suites.mutants.localised import localise_per_sample

    for m in CATALOGUE:
        if m.name in names and m.kind == "per_sample":
            try:
                out[m.name] = localise_per_sample(m, pool)
            except Exception as e:  # shown in the report as not localised, with why
                out[m.name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
        if m.name not in names or m.kind != "numeric":
            continue
        with tempfile.TemporaryDirectory(prefix="fsdp-localize-") as d:
            try:
                out[m.name] = replay(cell(m), pool=pool, workdir=Path(d))
            except Exception as e:  # shown in the report as not localised, with why
                out[m.name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
    return out


def _run_per_sample(m: Mutant, pool, seed: int) -> tuple[list[Verdict], list[Verdict]]:
    """(verdicts about the mutant's norms, verdicts about the product's norms) per (W, data mode)."""
    from harness.core.scenario import scenario_id
    from harness.per_sample.tasks import check_per_sample_norms, truth

    mutant, control = [], []
    for model in m.models:
        t = truth(model, seed, PER_SAMPLE_BATCH, PER_SAMPLE_STEP)
        for ws in m.world_sizes:
            for mode in m.data_modes:
                payload = {
                    "model": model,
                    "seed": seed,
                    "batch": PER_SAMPLE_BATCH,
                    "step": PER_SAMPLE_STEP,
                    "mode": mode,
                }
                ranks = pool.get(ws, "gloo").call(m.spec, payload)
                for variant, out in (("mutant", mutant), ("control", control)):
                    sid = scenario_id(m.name if variant == "mutant" else "fsdp_impl", model, ws, mode)
                    out.append(check_per_sample_norms(sid, [r["norms"][variant] for r in ranks], t.norms))
    return mutant, control


# ---------------------------------------------------------------------------------- the score


def score_table(run: CatalogueRun) -> pd.DataFrame:
    """One row per mutant: mutant | models what | expected check | caught by | where | caught?."""
    rows = []
    for r in run.results.values():
        m = r.mutant
        by = ", ".join(f"{c} ({n}/{len(r.scenarios)})" for c, n in r.caught_by.items()) or "nothing"
        rows.append(
            {
                "mutant": m.name,
                "models what": m.what,
                "cells": cells(m),
                "expected check": m.expected,
                "caught by": by,
                "where": r.where or "-",
                "caught?": "yes" if r.caught else "**NO**",
            }
        )
    return pd.DataFrame(
        rows, columns=["mutant", "models what", "cells", "expected check", "caught by", "where", "caught?"]
    )


def _alarm_lines(title: str, runs: list, through: str, note: str, margins: bool) -> list[str]:
    """A false-alarm section: the count, the summary per seed and implementation, the documented
    deviations seen, optionally how close the passes came to their bounds, and each alarm."""
    n_alarms = sum(len(r.false_alarms) for r in runs)
    n_scen = sum(len(r.scenarios) for r in runs)
    limits = [v for r in runs for v in r.model_limits]
    lines = [
        f"## {title}",
        "",
        f"**{n_alarms} false alarm(s)** in {n_scen} scenarios: {', '.join(fa.CORRECT)} (and the non-sharded "
        f"reference) through {through}, seeds {', '.join(str(r.seed) for r in runs)} "
        f"({sum(r.wall_s for r in runs):.0f} s). {note}"
        + (
            f" Apart from them, {len(limits)} model limit(s): scenarios the plain model itself cannot run (no "
            "implementation involved; each run's verdict says so), listed at the end."
            if limits
            else ""
        ),
        "",
        fa.summary(runs).to_markdown(index=False),
        "",
    ]
    known = fa.known(runs)
    if len(known):
        lines += ["Documented deviations seen:", "", known.to_markdown(index=False), ""]
    if margins:
        lines += [
            "How close the correct implementations came to each bound (the pass nearest its bound):",
            "",
            fa.margins(runs).to_markdown(index=False),
            "",
        ]
    origins = [o for r in runs for o in r.origins]
    if origins:
        lines += ["Where each saved part of the sweep ran (`--sweep-dir`):", ""] + [f"- {o}" for o in origins] + [""]
    return (
        lines
        + [f"- {v}" for r in runs for v in r.false_alarms]
        + (
            [f"Model limits: {len(limits)}", ""] + [f"- {v.scenario}: {str(v.message).splitlines()[0]}" for v in limits]
            if limits
            else []
        )
    )


def _false_alarm_section(runs: list) -> list[str]:
    if not runs:
        return [
            "## False alarms",
            "",
            "Not run in this report (`--false-alarm-seeds 0,1,2,3,4` adds the full-matrix tier; "
            "the quick matrix runs in every CI run: suites/mutants/test_false_alarms.py).",
            "",
        ]
    models = ", ".join(sorted({s.model for r in runs for s in r.scenarios}))
    return _alarm_lines(
        "False alarms",
        runs,
        f"the default matrix on {models}, {fa.FULL_STEPS} steps",
        "KNOWN verdicts are documented deviations of that implementation (harness/core/policy.py), "
        "held to the same bound and shown with their cause.",
        margins=True,
    )


def _composition_alarm_section(runs: list) -> list[str]:
    if not runs:
        return []
    return _alarm_lines(
        "False alarms of the CI compositions",
        runs,
        f"the CI compositions ({', '.join(fa.CI_COMPOSITIONS)}) on the mlp at W 1, 2, 4, both data "
        "modes, AdamW, 3 steps",
        "`--composition-seeds`; a composition an implementation cannot run "
        "(DDP has no hybrid mesh) is its unsupported verdict.",
        margins=False,
    )


def escaped_or_alarmed(run: CatalogueRun) -> bool:
    """True when the harness missed a mutant, failed a control, raised a false alarm, or mislocalised."""
    return (
        not all(r.caught for r in run.results.values())
        or not all(localised_ok(n, f) for n, f in run.localised.items())
        or bool(run.control_failures()[0])
        or not all(r.caught and r.only_there for r in run.invariant)
        or any(r.false_alarms or r.unjudged for r in run.false_alarms + run.composition_alarms)
    )


def render(run: CatalogueRun, *, full: bool = False) -> str:
    table = score_table(run)
    n, caught = len(run.results), sum(r.caught for r in run.results.values())
    escaped = [r.mutant.name for r in run.results.values() if not r.caught]
    bad_controls, control_limits = run.control_failures()
    lines = [
        "# Mutation score",
        "",
        f"**{caught}/{n} mutants caught** by the harness's checks ({caught / n:.0%}). Run time {run.wall_s:.0f} s.",
        "",
        "Each mutant is fsdp_impl with one injected fault (suites/mutants/catalog.py), run in the cells "
        "that expose it (`cells`; both data modes and both optimizers unless the mutant says otherwise) "
        + (
            "at every default world size and the full 10 steps (`--full-matrix`)"
            if full
            else "at small world sizes and 3 steps, as in CI (`--full-matrix` widens them to W 1,2,4,8 and 10 steps)"
        )
        + "; `caught by` counts the mutant's scenarios each check failed, `where` is the earliest failure "
        "of the expected check.",
        "",
        table.to_markdown(index=False),
        "",
    ]
    if escaped:
        lines += [
            f"**Escaped: {', '.join(escaped)}.** Sharpen the check or the scenario that should catch "
            "it (more steps, a larger learning rate, a model that exposes it), never the mutant.",
            "",
        ]
    lines += [
        "## Controls",
        "",
        f"{len({v.scenario for v in run.controls})} unmutated scenarios (the reference and "
        f"{', '.join(c for c, _ in CONTROLS)}) in the same cells: "
        + ("no check failed" if not bad_controls else f"{len(bad_controls)} FAILED")
        + (f" (apart from {len(control_limits)} model limit(s), below)" if control_limits else "")
        + ("." if not bad_controls else ":"),
    ]
    lines += [f"- {v}" for v in bad_controls] + [""]
    if control_limits:
        lines += [
            "Model limits: scenarios the plain model itself cannot run (no implementation involved; each "
            "run's verdict says so):",
            "",
        ]
        lines += [f"- {v.scenario}: {str(v.message).splitlines()[0]}" for v in control_limits] + [""]
    lines += exposure_section(run.exposure, run.results)
    lines += invariant_section(run.invariant)
    lines += _localised_section(run.localised)
    lines += _false_alarm_section(run.false_alarms)
    lines += _composition_alarm_section(run.composition_alarms)
    return "\n".join(lines).rstrip() + "\n"


def localised_ok(m_name: str, found) -> bool:
    """Whether the localiser named the mutant's recorded phase and module (suites/mutants/localised.py), or
    named nothing beyond rounding where the record says it cannot."""
    from harness.localize.per_sample import PerSampleLocalised
    from suites.mutants.localised import NOT_LOCALISED, PER_SAMPLE_WHERE, ROUNDING, WHERE

    if isinstance(found, str):
        return False
    if isinstance(found, PerSampleLocalised):
        where, kind = PER_SAMPLE_WHERE.get(m_name, (None, None))
        return found.where == where and kind in (found.collective or "")
    if m_name in NOT_LOCALISED:
        return not found.diverged
    p = found.point
    return p is not None and (p.phase, p.module) == WHERE.get(m_name) and p.rounding == (m_name in ROUNDING)


def _localised_section(located: dict) -> list[str]:
    from suites.mutants.localised import NOT_LOCALISED, PER_SAMPLE_CELL, PER_SAMPLE_WHERE, WHERE, cell

    if not located:
        return []
    rows = []
    for name, found in located.items():
        m = next(m for m in CATALOGUE if m.name == name)
        want = PER_SAMPLE_WHERE.get(name) if m.kind == "per_sample" else WHERE.get(name)
        named = found if isinstance(found, str) else found.short()
        where = (
            f"per-sample norms {PER_SAMPLE_CELL['model']} W{PER_SAMPLE_CELL['world_size']} {PER_SAMPLE_CELL['mode']}"
            if m.kind == "per_sample"
            else cell(m).id
        )
        rows.append(
            {
                "mutant": name,
                "cell": where,
                "defect is in": f"{want[0]}, {want[1]}" if want else f"(cannot: {NOT_LOCALISED.get(name, '?')})",
                "localiser named": named,
                "right?": "yes" if localised_ok(name, found) else "**NO**",
            }
        )
    ok = sum(r["right?"] == "yes" for r in rows)
    exceptions = [n for n in located if n in NOT_LOCALISED]
    return [
        "## Localised",
        "",
        f"**{ok - len(exceptions)}/{len(rows) - len(exceptions)} numeric and per-sample mutants localised** to the "
        "phase and module where their defect is (`python -m harness localize`, harness/localize/; a per-sample "
        "mutant to its side of the exchange and the collective, harness/localize/per_sample.py), each in one cell"
        + (
            f"; {len(exceptions)} cannot be, each with its cause ({', '.join(exceptions)}): the localiser "
            "names nothing beyond rounding there, as it should"
            if exceptions
            else ""
        )
        + ".",
        "",
        pd.DataFrame(rows).to_markdown(index=False),
        "",
    ]


def _model_list(text: str) -> tuple[str, ...]:
    from harness.options import models

    return fa.STANDARD if text == "standard" else models(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m reports.mutation_score", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma list of mutant names (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"report path (default {DEFAULT_OUT})")
    p.add_argument(
        "--false-alarm-seeds",
        type=seed_list,
        default=(),
        metavar="S,...",
        help="also run fsdp_impl, torch_fsdp2 and ddp through the full default matrix under "
        "these seeds (about 4 minutes a seed on 2 cores)",
    )
    p.add_argument(
        "--false-alarm-models",
        type=_model_list,
        default=fa.DEFAULT_MODELS,
        metavar="M,...",
        help="the models of the false-alarm tier: zoo names, or 'standard' for the standard "
        f"architectures ({','.join(fa.STANDARD)}); default {','.join(fa.DEFAULT_MODELS)}",
    )
    p.add_argument(
        "--mutant-models",
        type=_model_list,
        default=(),
        metavar="M,...",
        help="run the mutants that run on the mlp on these models instead ('standard': the "
        "standard architectures), to show they are caught on models the checks were not "
        "tuned on",
    )
    p.add_argument(
        "--full-matrix",
        action="store_true",
        help="run every mutant at world sizes 1,2,4,8 and 10 steps (about 20 minutes on 2 cores) "
        "instead of the small cells the CI suite uses",
    )
    p.add_argument(
        "--no-localise",
        action="store_true",
        help="skip the second score: each numeric mutant localised in its cell (about a minute)",
    )
    p.add_argument(
        "--composition-seeds",
        type=seed_list,
        default=(),
        metavar="S,...",
        help="also run fsdp_impl, torch_fsdp2 and ddp through the CI compositions under these seeds "
        "(about a minute a seed on 2 cores)",
    )
    p.add_argument(
        "--no-exposure",
        action="store_true",
        help="skip running the composition and surface mutants in their counterpart cells, where each "
        "must escape (suites/mutants/exposure.py; about two minutes)",
    )
    p.add_argument(
        "--sweep-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="save the false-alarm sweep to DIR one (seed, model) at a time as each finishes, and read "
        "back what DIR already holds: a sweep of hours can be stopped and resumed",
    )
    p.add_argument(
        "--sweep-jobs",
        type=positive_int,
        default=1,
        metavar="N",
        help="with --sweep-dir: run N (seed, model) parts of the sweep at a time, each in a process of its "
        "own (a part's worlds take up to 8 cores: on 16 cores, about 6)",
    )
    p.add_argument(
        "--no-invariant",
        action="store_true",
        help="skip the faults of the batch-invariant step (suites/mutants/invariant_score.py: the tier, "
        "and the default matrix where nothing may catch them; about two minutes)",
    )
    p.add_argument("--quiet", action="store_true")
    ns = p.parse_args(argv)
    if ns.sweep_jobs > 1 and ns.sweep_dir is None:
        p.error("--sweep-jobs runs the parts of a saved sweep: give --sweep-dir DIR too")
    names = [n for n in ns.only.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in CATALOGUE})
    if unknown:
        p.error(f"unknown mutant(s) {', '.join(unknown)}; known: {', '.join(m.name for m in CATALOGUE)}")
    mutants = [widened(m) if ns.full_matrix else m for m in CATALOGUE if not names or m.name in names]
    mutants = [on_models(m, ns.mutant_models) for m in mutants] if ns.mutant_models else mutants
    progress = (
        None if ns.quiet else (lambda i, n, sc, s: sys.stderr.write(f"[mutants] {i:>3}/{n} {sc.id:<64} {s:5.1f}s\n"))
    )
    run = run_catalogue(
        mutants,
        false_alarm_seeds=ns.false_alarm_seeds,
        progress=progress,
        false_alarm_models=ns.false_alarm_models,
        localise=not ns.no_localise,
        exposure=not ns.no_exposure,
        composition_seeds=ns.composition_seeds,
        sweep_dir=ns.sweep_dir,
        sweep_jobs=ns.sweep_jobs,
        invariant=not ns.no_invariant,
    )
    path = write_text_atomic(ns.out, render(run, full=ns.full_matrix))
    caught = sum(r.caught for r in run.results.values())
    alarms = sum(len(r.false_alarms) for r in run.false_alarms)
    sys.stderr.write(
        f"{caught}/{len(run.results)} mutants caught"
        + (
            f"; {alarms} false alarm(s) over seeds {','.join(map(str, ns.false_alarm_seeds))}"
            if ns.false_alarm_seeds
            else ""
        )
        + f"; report: {path}\n"
    )
    return 1 if escaped_or_alarmed(run) else 0


if __name__ == "__main__":
    sys.exit(main())
