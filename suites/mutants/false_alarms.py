"""False alarms: the correct implementations run through the matrix, where no verdict may FAIL.

A harness that catches every mutant by failing everything is worthless. The slow tier runs the
default matrix (models, world sizes 1/2/4/8, both data modes, both optimizers, every feature, 10 steps) for
``fsdp_impl``, PyTorch FSDP2 and DDP under several seeds (init and data both change). KNOWN verdicts
are documented deviations of a real implementation (harness/core/policy.py), shown and counted, never
hidden. ``margins`` says how close the passes came to their bounds: a check that passes with a
measured value at 90% of its bound is one seed away from a false alarm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.core.features import FEATURES, named
from harness.core.names import STANDARD_MODELS
from harness.core.scenario import DATA_MODES, OPTIMIZERS, REFERENCE_IMPL, Scenario, build_matrix
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, Verdict
from harness.options import DEFAULT_MODELS, DEFAULT_WORLD_SIZES
from harness.tables.build import MODEL_LIMIT

CORRECT = ("fsdp_impl", "torch_fsdp2", "ddp")
SEEDS = (0, 1, 2, 3, 4)
FULL_STEPS = 10
# the compositions CI runs (suites/harness/end_to_end/test_compositions.py): the everyday pairs, each part a real bug's home
CI_COMPOSITIONS = (
    "hsdp+clip",
    "hsdp+no_sync",
    "hsdp+ckpt",
    "accum+clip",
    "no_sync+clip",
    "bf16+accum",
    "bf16+ckpt",
    "bf16+clip_inf",
    "ac+bf16",
    "ckpt+no_sync",
    "bf16+hsdp",  # the wrap settings at once: one wrap(..., options) with both
    "hsdp+offload",
    "bf16+offload",
)


def quick_matrix() -> list[Scenario]:
    """One seed, W in {1, 2}, 3 steps, in every CI run: DDP's plain step (the README's test command
    runs fsdp_impl's and FSDP2's in its own matrix, at every world size), and every other feature for
    all three with AdamW and replicated data on mlp and tinylm_tied (how a feature treats gradients
    depends neither on the optimizer nor on the data split; tinylm_tied has the tied weight, mlp the
    smallest rows; the full tier runs every combination). The eval pass, whose forward changes no
    gradient, runs in two cells only: FSDP2 and DDP on the mlp at W = 2 with split data (each rank
    evaluates its slice, the loss is all-reduced); fsdp_impl's eval runs as the control beside the
    no_grad_forward_unsharded mutant (replicated data, W = 1, 2). Not jitter, whose delays are seconds of
    sleep per cell: suites/harness/end_to_end/test_jitter.py runs its cells for all three; not reshard2, the plain step at
    W <= 2: suites/harness/end_to_end/test_fsdp2_surface.py runs it at 4 ranks."""
    plain = build_matrix(("ddp",), list(DEFAULT_MODELS), [1, 2], DATA_MODES, OPTIMIZERS, steps=3)
    others = [f for f in FEATURES if f not in ("plain", "eval", "reshard2") and f not in named("timing_only")]
    featured = build_matrix(
        CORRECT, ["mlp", "tinylm_tied"], [1, 2], ("replicated",), ("adamw",), steps=3, features=others
    )
    evaluated = build_matrix(("torch_fsdp2", "ddp"), ["mlp"], [2], ("split",), ("adamw",), steps=3, features=("eval",))
    cells = plain + [c for c in featured if c not in plain]
    return cells + [c for c in evaluated if c not in cells]


def full_matrix(seed: int, models=DEFAULT_MODELS) -> list[Scenario]:
    """The default matrix for every correct implementation and every feature, under one seed."""
    return build_matrix(
        CORRECT,
        list(models),
        list(DEFAULT_WORLD_SIZES),
        DATA_MODES,
        OPTIMIZERS,
        steps=FULL_STEPS,
        seeds=(seed,),
        features=FEATURES,
    )


# architectures the bounds were not tuned on: harness/train/standard_models.py (nn.MultiheadAttention,
# nn.TransformerEncoderLayer with a padding embedding, BatchNorm) and Hugging Face GPT-2 with its attention
# biases (the `hf` extra)
STANDARD = STANDARD_MODELS + ("hf:gpt2",)


def composition_matrix(seed: int) -> list[Scenario]:
    """The CI compositions for fsdp_impl, FSDP2 and DDP under one seed (mlp, W 1, 2, 4, both data modes, AdamW,
    3 steps; a composition DDP cannot run is its unsupported verdict): the cells of the slow five-seed tier. The
    README's test command runs them at W 1, 2 (1, 4 for those with hsdp), seed 0 (suites/harness/end_to_end/test_compositions.py)."""
    from harness.core.features import check_feature

    return build_matrix(
        CORRECT,
        ["mlp"],
        [1, 2, 4],
        DATA_MODES,
        ("adamw",),
        steps=3,
        seeds=(seed,),
        features=tuple(check_feature(c) for c in CI_COMPOSITIONS),
    )


def standard_matrix(seed: int) -> list[Scenario]:
    """The same on the standard architectures (STANDARD)."""
    return full_matrix(seed, STANDARD)


@dataclass
class FalseAlarmRun:
    seed: int
    scenarios: list[Scenario]
    verdicts: list[Verdict]
    wall_s: float
    # a saved sweep's chunks, one line each: model, commit, torch, CPU kernels, cores, wall time
    origins: list[str] = dataclasses.field(default_factory=list)

    @property
    def impl_of(self) -> dict[str, str]:
        """scenario id -> implementation."""
        return {s.id: s.impl for s in self.scenarios}

    @property
    def false_alarms(self) -> list[Verdict]:
        """Failures of a correct implementation, or of a check on the plain model's own runs: every FAIL but
        the model limits."""
        limits = self._model_limit_ids()
        return [v for v in self.verdicts if v.status == FAIL and id(v) not in limits]

    @property
    def model_limits(self) -> list[Verdict]:
        """The plain model itself failing a scenario (harness.tables.build.model_limit: a BatchNorm under the
        bf16 policy, a one-sample micro-batch of batch statistics): no implementation is involved, and the
        run says so; counted apart from the false alarms."""
        limits = self._model_limit_ids()
        return [v for v in self.verdicts if id(v) in limits]

    def _model_limit_ids(self) -> set[int]:
        return model_limit_ids(self.verdicts, self.impl_of)  # impl_of built once: a part has ~9,000 verdicts

    @property
    def unjudged(self) -> set[str]:
        """Scenarios that got no verdict at all (a run that silently dropped them is no evidence)."""
        return {s.id for s in self.scenarios} - {v.scenario for v in self.verdicts if v.scenario}


def model_limit_ids(verdicts: list[Verdict], impl_of: dict[str, str]) -> set[int]:
    """id() of each verdict in which the plain model itself fails its scenario (a model limit: no
    implementation involved); `impl_of`: scenario id -> implementation."""
    return {
        id(v)
        for v in verdicts
        if v.status == FAIL and impl_of.get(v.scenario) == REFERENCE_IMPL and str(v.message).startswith(MODEL_LIMIT)
    }


def run_false_alarms(scenarios: list[Scenario], *, seed: int, pool=None, progress=None, journal=None) -> FalseAlarmRun:
    from harness.phases import run_matrix

    t0 = time.perf_counter()
    res = run_matrix(scenarios, pool=pool, progress=progress, journal=journal)
    return FalseAlarmRun(seed, scenarios, res.verdicts, time.perf_counter() - t0)


def run_saved(seed: int, models, save_dir: Path, *, pool=None, progress=None, log=None) -> FalseAlarmRun:
    """The full matrix of `seed` on `models`, one model at a time, each model's verdicts saved to
    `save_dir` as soon as it is judged (every check compares runs of one model only, so a model is a
    complete unit). A model whose file is there already is read back instead of run: an hour-long sweep
    can be stopped and resumed, and a stopped one still leaves its finished models behind. A file made
    for another matrix (the scenario ids differ: the code changed) is refused, not mixed in. A model that
    stopped half way resumes too: its scenarios are journaled in `unfinished_dir` as they are run
    (harness.execute.journal; refused if other code started it), and the journal is removed once the
    model's file is saved."""
    save_dir.mkdir(parents=True, exist_ok=True)
    scenarios, verdicts, wall, origins = [], [], 0.0, []
    made_with = _commit()  # the code this process runs: read now, not when a part is saved (HEAD may move)
    for model in models:
        cells = full_matrix(seed, [model])
        path = saved_part(save_dir, seed, model)
        if path is not None:
            saved = read_part(path)
            if saved["scenarios"] != [c.id for c in cells]:
                raise SystemExit(f"{path} was made for another matrix (the code changed since): move it away")
            got = [Verdict(**v) for v in saved["verdicts"]]
            wall += saved["wall_s"]
            origins.append(_origin(saved))
            if log:
                log(f"seed {seed}, {model}: read back from {path} ({saved['commit']})")
        else:
            from harness.execute.journal import Journal, JournalMismatch

            try:
                journal = Journal(unfinished_dir(save_dir, seed, model), made_with)
            except JournalMismatch as e:
                raise SystemExit(str(e)) from None
            if log and len(journal):
                log(
                    f"seed {seed}, {model}: resuming, {len(journal)} of {len(cells)} scenarios already run "
                    f"({journal.root})"
                )
            run = run_false_alarms(cells, seed=seed, pool=pool, progress=progress, journal=journal)
            got, wall = run.verdicts, wall + run.wall_s
            saved = {
                "seed": seed,
                "model": model,
                "commit": made_with,
                **_machine(),
                "wall_s": run.wall_s,
                "scenarios": [c.id for c in cells],
                "verdicts": [dataclasses.asdict(v) for v in got],
            }
            path = part_path(save_dir, seed, model)
            part = path.with_name(path.name + ".part")  # written whole, then put in place: a stop leaves no half
            with gzip.open(part, "wt", encoding="utf-8") as f:  # a part's verdicts: 3 MB of JSON, 75 KB gzipped
                json.dump(saved, f)
            part.replace(path)
            shutil.rmtree(journal.root)
            with contextlib.suppress(OSError):  # the last unfinished part gone: its folder too
                journal.root.parent.rmdir()
            origins.append(_origin(saved))
            if log:
                done = FalseAlarmRun(seed, cells, got, run.wall_s)
                log(
                    f"seed {seed}, {model}: {len(done.false_alarms)} false alarm(s), {len(done.model_limits)} "
                    f"model limit(s), saved to {path}"
                )
        scenarios += [c for c in cells if c not in scenarios]
        verdicts += got
    return FalseAlarmRun(seed, scenarios, verdicts, wall, origins)


def part_path(save_dir: Path, seed: int, model: str) -> Path:
    """Where a saved sweep keeps the verdicts of (seed, model), gzipped (small enough to commit, so that a sweep
    of hours goes on in another session, on another machine)."""
    return save_dir / f"seed{seed}-{model.replace(':', '_')}.json.gz"


def unfinished_dir(save_dir: Path, seed: int, model: str) -> Path:
    """Where the part (seed, model) keeps its journal until it is saved (ignored by git: snapshots, gigabytes)."""
    return save_dir / "unfinished" / part_path(save_dir, seed, model).name.removesuffix(".json.gz")


def saved_part(save_dir: Path, seed: int, model: str) -> Path | None:
    """The saved verdicts of (seed, model): gzipped, or plain JSON as the first sweeps saved them; None if neither."""
    gz = part_path(save_dir, seed, model)
    plain = gz.with_suffix("")
    return gz if gz.exists() else plain if plain.exists() else None


def read_part(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def part_command(seed: int, model: str, save_dir: Path) -> list[str]:
    """The process that runs one (seed, model) part of a sweep and saves it (this module's main)."""
    return [sys.executable, "-m", "suites.mutants.false_alarms", str(seed), model, str(save_dir)]


def run_parts(seeds, models, save_dir: Path, jobs: int, *, log=None, poll_s: float = 1.0) -> None:
    """The (seed, model) parts of a sweep not yet in `save_dir`, `jobs` at a time, each in a process of its own
    (`part_command`) that saves it as run_saved does: a machine with many cores runs the hours of a five-seed
    sweep that many times faster (each part's worlds take at most 8 cores). Each part's output goes to
    `save_dir/log-seed<S>-<model>.txt`. A part that fails stops the others and is named with its log; what
    finished stays saved, and run_saved reads it all back afterwards."""
    save_dir.mkdir(parents=True, exist_ok=True)
    todo = [(s, m) for s in seeds for m in models if saved_part(save_dir, s, m) is None]
    running: dict = {}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                seed, model = todo.pop(0)
                out = save_dir / f"log-seed{seed}-{model.replace(':', '_')}.txt"
                with open(out, "w") as f:
                    running[(seed, model)] = (
                        subprocess.Popen(
                            part_command(seed, model, save_dir),
                            stdout=f,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                        ),
                        out,
                    )
                if log:
                    log(f"seed {seed}, {model}: started ({len(running)} running, {len(todo)} waiting)")
            time.sleep(poll_s)
            for part, (proc, out) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[part]
                if rc != 0 or saved_part(save_dir, *part) is None:
                    raise SystemExit(f"the sweep's part seed {part[0]}, {part[1]} failed (exit {rc}); its log: {out}")
                if log:
                    log(f"seed {part[0]}, {part[1]}: saved ({len(running)} running, {len(todo)} waiting)")
    finally:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()


def _origin(saved: dict) -> str:
    """One line on where a saved chunk ran (files saved before the machine was recorded say so)."""
    where = (
        f"torch {saved['torch']}, {saved['cpu_kernels']}, {saved['cores']} cores"
        if "torch" in saved
        else "machine not recorded"
    )
    return f"seed {saved['seed']}, {saved['model']}: commit {saved['commit']}, {where}, {saved['wall_s']:.0f} s"


def _machine() -> dict:
    """Where a saved chunk ran: chunks of one sweep may come from different machines (a sweep of hours is
    resumed elsewhere), and the report says which."""
    import os

    import torch

    return {"torch": torch.__version__, "cpu_kernels": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count()}


def _commit() -> str:
    """The code a saved chunk was made with: the commit, '+ changes' when the tree differs from it."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" + changes" if dirty else "")


def summary(runs: list[FalseAlarmRun]) -> pd.DataFrame:
    """seed | implementation | scenarios | pass | known | skip | fail: one row per (seed, impl)."""
    rows = []
    for run in runs:
        impl_of = run.impl_of
        for impl in sorted(set(impl_of.values())):
            mine = [v for v in run.verdicts if impl_of.get(v.scenario) == impl]
            rows.append(
                {
                    "seed": run.seed,
                    "implementation": impl,
                    "scenarios": sum(i == impl for i in impl_of.values()),
                    **{s: sum(v.status == s for v in mine) for s in (PASS, KNOWN, SKIP, FAIL)},
                }
            )
    return pd.DataFrame(rows, columns=["seed", "implementation", "scenarios", PASS, KNOWN, SKIP, FAIL])


def margins(runs: list[FalseAlarmRun]) -> pd.DataFrame:
    """Per (check, implementation), over every run: the passing verdict closest to its bound.

    Only checks that pass when measured <= bound with a positive bound have a margin; checks with
    other semantics (e.g. converges, whose bound is 0) are left out rather than misreported."""
    best: dict[tuple[str, str], tuple[float, Verdict, int]] = {}
    for run in runs:
        impl_of = run.impl_of
        for v in run.verdicts:
            if v.status != PASS or v.measured is None or not v.bound or v.bound <= 0 or v.measured < 0:
                continue
            r, key = v.measured / v.bound, (v.check, impl_of.get(v.scenario, "?"))
            if r <= 1 and (key not in best or r > best[key][0]):
                best[key] = (r, v, run.seed)
    rows = [
        {
            "check": c,
            "implementation": impl,
            "closest pass": f"{v.measured:.3g} of {v.bound:.3g} ({r:.0%})",
            "seed": s,
            "scenario": v.scenario,
        }
        for (c, impl), (r, v, s) in sorted(best.items())
    ]
    return pd.DataFrame(rows, columns=["check", "implementation", "closest pass", "seed", "scenario"])


def known(runs: list[FalseAlarmRun]) -> pd.DataFrame:
    """The documented deviations seen: check | implementation | count | largest measured | bound."""
    rows = []
    for run in runs:
        impl_of = run.impl_of
        rows += [
            {"check": v.check, "implementation": impl_of.get(v.scenario, "?"), "measured": v.measured, "bound": v.bound}
            for v in run.verdicts
            if v.status == KNOWN
        ]
    if not rows:
        return pd.DataFrame(columns=["check", "implementation", "verdicts", "largest measured", "bound"])
    df = pd.DataFrame(rows)
    out = df.groupby(["check", "implementation"]).agg(
        verdicts=("measured", "size"), largest=("measured", "max"), bound=("bound", "max")
    )
    out = out.reset_index().rename(columns={"largest": "largest measured"})
    out["largest measured"] = [f"{x:.3g}" for x in out["largest measured"]]
    out["bound"] = [f"{x:.3g}" for x in out["bound"]]
    return out


def _main(argv: list[str]) -> int:
    """python -m suites.mutants.false_alarms SEED MODEL DIR: one part of a saved sweep (run_parts starts these)."""
    seed, model, save_dir = int(argv[0]), argv[1], Path(argv[2])
    run = run_saved(
        seed,
        [model],
        save_dir,
        log=print,
        progress=lambda i, n, sc, s: print(f"[{i}/{n}] {sc.id} {s:.1f}s", flush=True),
    )
    print(
        f"seed {seed}, {model}: {len(run.false_alarms)} false alarm(s), {len(run.model_limits)} model limit(s), "
        f"{len(run.unjudged)} unjudged"
    )
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
