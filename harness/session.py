"""One verification session: the flow that `python -m harness run` and the pytest plugin both drive.

    options -> the phases (harness.phases: matrix, replay, localise, per-sample, invariant, gate), on one pool of
    worlds or in a torchrun job -> outputs (report, tables, baseline) -> exit status

The exit status follows the run's outcome (harness.core.outcome): EXIT_OK when every implementation
under test ran and no verdict failed; EXIT_FAILED when a verdict failed or a scenario errored;
EXIT_NOT_RUN when nothing failed but an implementation under test ran no scenario (every one unsupported),
so that a run which verified nothing is never read as a pass; EXIT_USAGE (the CLI's) for
bad input; EXIT_INTERRUPTED (the CLI's, 128 + SIGINT as a shell reports it) for a run ended by Ctrl-C,
SIGTERM or SIGHUP, with the one line "interrupted" and no outputs written.

Both entries build a `Session` from the same options and get the same tables, verdicts, report,
baseline and exit status. Outputs (the report with its plots, the `<report>_tables/` folder and a
saved baseline) are staged in a temp folder and swapped into place together, so a reader never
sees a report from one run beside tables from another, and an interrupted run leaves the previous
outputs as they were. The default report goes to a folder of the run's own, `reports/runs/<time>/`,
with `reports/latest` pointing at the newest (harness.report.runs); `--report PATH` writes PATH.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from harness import options as opt
from harness.core.scenario import REFERENCE_IMPL, Scenario, with_dependencies
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, UNSUPPORTED, Verdict
from harness.options import SessionOptions

if TYPE_CHECKING:  # torch and pandas load only once a run starts: a usage error stays instant
    from harness.core.outcome import Outcome
    from harness.execute.world import WorldPool
    from harness.phases import RunResult

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUN = 0, 1, 2, 3
EXIT_INTERRUPTED = 130
# Packages that add a section to the report: each registers it when imported (harness.report.sections).
REPORT_SECTION_PACKAGES = ("harness.per_sample", "harness.localize", "harness.invariant")


def _check_invariant_cells(m: opt.MatrixOptions) -> None:
    """--invariant's cells: L micro-batches (harness.core.policy.INVARIANT_MICRO_BATCHES) that every world size
    divides and that divide the global batch; a usage error naming the cause otherwise."""
    from harness.core.policy import INVARIANT_MICRO_BATCHES as L

    bad = [w for w in m.world_sizes if L % w]
    if bad or m.global_batch % L:
        raise opt.argparse.ArgumentTypeError(
            f"--invariant cuts the global batch into {L} micro-batches, summed in one binary tree: every world size "
            f"must divide {L} (not {', '.join(map(str, bad))})"
            if bad
            else f"--invariant cuts the global batch into {L} micro-batches: --global-batch {m.global_batch} is not a "
            f"multiple of {L}"
        )


def load_report_sections() -> None:
    """Import the packages that add report sections, so a report rendered here, from a run or from
    stored tables, shows their data whenever the tables hold it."""
    for name in REPORT_SECTION_PACKAGES:
        importlib.import_module(name)


def tables_dir(report: Path) -> Path:
    """Where a report's tables go: `<report stem>_tables/` beside it."""
    return Path(report).with_name(f"{Path(report).stem}_tables")


def session_options(ns, *, preflight: bool = True) -> SessionOptions:
    """The session's options from parsed CLI or pytest options. `preflight=False`: the checks that build the models
    and user objects (harness.preflight) are skipped, for a process whose parent ran them on the same options (an
    xdist worker: its controller did)."""
    from harness import preflight as checks

    return SessionOptions.from_namespace(ns, checks.checked_matrix(ns) if preflight else opt.matrix_from(ns))


class Session:
    """Runs the matrix once (lazily), then writes every output together and gives the exit status.

    `say` prints one progress line (stderr by default); `under_torchrun` runs the matrix in the
    job torchrun started instead of in reused worlds (rank 0 alone writes outputs); `command` is the
    command line that made the run, recorded in its environment so that its report says how to
    reproduce it (None: this process's own, harness.core.environment)."""

    def __init__(
        self,
        options: SessionOptions,
        *,
        say: Callable[[str], None] | None = None,
        under_torchrun: bool = False,
        command: str | None = None,
    ):
        self.options = options
        self.say = say or _stderr
        self.under_torchrun = under_torchrun
        self.command = command
        if under_torchrun and options.per_sample:
            raise opt.argparse.ArgumentTypeError(
                "--per-sample is not available under torchrun yet; run it "
                "without torchrun (python -m harness run --per-sample ...)"
            )
        if under_torchrun and options.invariant:
            raise opt.argparse.ArgumentTypeError(
                "--invariant is not available under torchrun yet; run it without "
                "torchrun (python -m harness run --invariant ...)"
            )
        if options.invariant:
            _check_invariant_cells(options.matrix)
        if under_torchrun:  # before anything runs: one usage line, not a progress line first
            from harness.execute.launch import check_job_fits

            check_job_fits(options.matrix.world_sizes, int(os.environ["WORLD_SIZE"]))
        backend = options.matrix.backend
        self.baseline = opt.load_baseline_option(options.baseline, options.gate, backend, options.gate_strict)
        self.result: RunResult | None = None
        self.is_writer = True  # False on torchrun ranks other than 0
        self.report = options.report  # where the report is: in its run's folder once written
        self.notes: list[str] = []  # what writing the outputs moved or removed besides (harness.report.runs)

    # Runtime #

    def scenarios(self, selected: set[str] | None = None) -> list[Scenario]:
        """The matrix, or the part of it that `selected` ids need (with what they compare with)."""
        every = self.options.matrix.scenarios()
        if selected is None:
            return every
        return with_dependencies([s for s in every if s.id in selected])

    def run(self, selected: set[str] | None = None, worlds: WorldPool | None = None) -> RunResult | None:
        """Run the (selected) matrix and the phases after it (harness.phases) once, on one pool of worlds; later
        calls return the same result. None on torchrun ranks other than 0. `worlds`: the pool to run in, its
        caller's to close (harness.bench.harness_cost pairs each run with its bare training there); by default one
        made and closed here."""
        if self.result is not None or not self.is_writer:
            return self.result
        from harness.execute.world import WorldPool
        from harness.phases import Run, run_phases

        m, scenarios = self.options.matrix, self.scenarios(selected)
        where = "this torchrun job" if self.under_torchrun else "worlds"
        self.say(
            f"running {len(scenarios)} scenarios in {where} of {','.join(map(str, m.world_sizes))} ranks "
            f"({_planned(scenarios)})"
        )

        def progress(i, n, sc, secs):
            self.say(f"[{i:>3}/{n}] {sc.id:<48} {secs:6.1f}s")

        with contextlib.ExitStack() as stack:
            if self.under_torchrun:
                pool = None
            else:
                pool = worlds if worlds is not None else stack.enter_context(WorldPool(timeout_s=m.timeout_s))
            res = run_phases(
                Run(self.options, scenarios, pool, say=self.say, progress=progress, baseline=self.baseline)
            )
            if res is not None and pool is not None:
                res.phase_s["world starts"] = pool.start_s  # inside the phases' seconds: where each world began
                res.world_start_s = dict(pool.start_s_by_size)
        if res is None:
            self.is_writer = False
            return None
        if self.command is not None:
            res.env["command"] = self.command
        self.result = res
        return res

    # Outputs #

    def write_outputs(self) -> list[Path]:
        """Report (+ plots), tables and a saved baseline, swapped into place together; the default
        report in a new run folder, which `reports/latest` then points at."""
        from harness.gate.baseline import baseline_file, baseline_text
        from harness.report import runs
        from harness.report.markdown import stage_report
        from harness.tables.store import stage_run, swap_into_place, writing

        res, o = self.result, self.options
        if res is None or (o.report is None and not o.save_baseline):
            return []
        load_report_sections()
        # each output is staged beside its destination: os.replace cannot move across file systems
        # (a report on a tmpfs /tmp, the baselines in the checkout)
        staging: list[Path] = []
        made: list[Path] = []  # folders this write created, removed again if it fails

        def stage_dir(dst: Path) -> Path:
            with writing(dst):
                missing = [p for p in (dst.parent, *dst.parent.parents) if not p.exists()]
                dst.parent.mkdir(parents=True, exist_ok=True)
                made.extend(missing)
                staging.append(Path(tempfile.mkdtemp(dir=dst.parent, prefix=".fsdp-harness-out-")))
            return staging[-1]

        moves: list[tuple[Path, Path]] = []
        run_folder = None
        report = o.report
        try:
            if report == opt.DEFAULT_REPORT:
                with writing(runs.RUNS):
                    run_folder, new = runs.new_run_folder()
                made.extend(new)
                report = run_folder / opt.DEFAULT_REPORT.name
            if report is not None:
                tmp = stage_dir(Path(report))
                with writing(report):  # staging: a full disk here is the same one-line error
                    moves += stage_report(res.tables, res.env, report, tmp, plots=o.plots)
                    moves.append((stage_run(res.tables, res.env, tmp / "tables"), tables_dir(report)))
            if o.save_baseline:
                dst = baseline_file(o.save_baseline, res.env)
                staged = stage_dir(dst) / "baseline.json"
                with writing(dst):
                    staged.write_text(baseline_text(res.tables, res.env, o.save_baseline), encoding="utf-8")
                moves.append((staged, dst))
            swap_into_place(moves)
        except BaseException:
            _remove(staging)
            for folder in sorted(made, key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: a failed write leaves no new empty folder behind
            raise
        _remove(staging)
        self.report = report
        if run_folder is not None:
            with writing(runs.LATEST):
                self.notes = runs.publish(run_folder)
        return [dst for _, dst in moves]

    def outcome(self) -> Outcome:
        """The run's outcome (harness.core.outcome), from its scenarios and verdict tables."""
        import pandas as pd

        from harness.checks.registry import verdict_table
        from harness.core.outcome import outcome

        res = self.result
        tables = res.tables if res is not None else {}
        cells, verdicts = tables.get("scenarios"), tables.get("verdicts")
        if verdicts is None:  # a result made by hand, not by the phases (which make the table once)
            verdicts = verdict_table(res.verdicts if res is not None else [])
        return outcome(cells if cells is not None else pd.DataFrame(), verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in (self.result.verdicts if self.result else []) if v.status == FAIL]

    def exit_status(self) -> int:
        from harness.core.outcome import FAILED, PASSED

        word = self.outcome().word
        return EXIT_OK if word == PASSED else EXIT_FAILED if word == FAILED else EXIT_NOT_RUN

    def summary_line(self) -> str:
        """'PASS: 336 passed, 0 failed, 0 known deviations, 73 skipped (the reference's runs apart: 60 passed,
        0 failed); fsdp_impl: 12 ran, 0 unsupported; ...; gate: ...; in 13.0s; report: PATH'."""
        o = self.outcome()
        n, ref = o.counts, o.reference
        unsupported = f", {n[UNSUPPORTED]} unsupported" if n[UNSUPPORTED] else ""
        reference = (
            f" (the reference's runs apart: {ref[PASS]} passed, {ref[FAIL]} failed)" if sum(ref.values()) else ""
        )
        parts = [
            f"{o.word}: {n[PASS]} passed, {n[FAIL]} failed, {n[KNOWN]} known deviations, {n[SKIP]} skipped"
            f"{unsupported}{reference}",
            o.runs,
            o.gate,
            f"in {self.result.wall_s:.1f}s" if self.result else "",
            f"report: {self.report}" if self.report is not None else "",
        ]
        return "; ".join(p for p in parts if p)

    def finish(self) -> int:
        """Write the outputs and say where they went; the exit status (`exit_status`).
        A failed write raises harness.tables.store.OutputError (one line; earlier outputs left in place)."""
        if self.result is None:
            return EXIT_OK
        for path in self.write_outputs():
            self.say(f"wrote {path}")
        for note in self.notes:
            self.say(note)
        return self.exit_status()


def _planned(scenarios: list[Scenario]) -> str:
    """'fsdp_impl: 12 to run, 0 unsupported; reference: 6 to run, 0 unsupported': per implementation, the
    reference last; a scenario whose adapter lacks what its feature needs will not run (unsupported)."""
    from harness.execute.executor import unsupported

    impls = list(dict.fromkeys(sc.impl for sc in scenarios))
    parts = []
    for impl in sorted(impls, key=lambda i: i == REFERENCE_IMPL):
        mine = [sc for sc in scenarios if sc.impl == impl]
        skipped = sum(unsupported(sc) is not None for sc in mine)
        parts.append(f"{impl}: {len(mine) - skipped} to run, {skipped} unsupported")
    return "; ".join(parts)


def _remove(folders: list[Path]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
