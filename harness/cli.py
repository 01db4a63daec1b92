"""Command line: `python -m harness run|report|compare|plan|localize ...` (also installed as `fsdp-harness`).

`run` exits with the run's outcome (harness.session): 0 PASS, 1 FAIL (a verdict failed or a
scenario errored, an implementation's that raised in every scenario included), 2 bad input, 3 NOT RUN (an
implementation under test had no scenario it supports);
130 with the one line "interrupted" when Ctrl-C, SIGTERM or SIGHUP ends it, whatever it was doing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from harness import options as opt
from harness.core import interrupt
from harness.execute.launch import NotLaunchedHere, a_torchrun_rank_but_0, launched_by_torchrun, let_rank_0_say
from harness.session import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_RUN,
    EXIT_OK,
    EXIT_USAGE,
    Session,
    load_report_sections,
    session_options,
)

EXIT_STATUSES = (
    f"exit status: {EXIT_OK} PASS (every implementation under test ran, no verdict failed); "
    f"{EXIT_FAILED} FAIL (a verdict failed or a scenario errored, in every scenario too); {EXIT_USAGE} bad input; "
    f"{EXIT_NOT_RUN} NOT RUN (nothing failed, but an implementation under test ran no scenario: every one "
    f"unsupported); {EXIT_INTERRUPTED} interrupted (Ctrl-C, SIGTERM, SIGHUP)"
)


class _Parser(argparse.ArgumentParser):
    """Under torchrun every rank has the same command line and the same job, so an error in them is
    every rank's: rank 0 alone says it (`exit_for_the_job`)."""

    def error(self, message):
        if a_torchrun_rank_but_0():
            self.exit_for_the_job(EXIT_USAGE, f"{self.prog}: error: {message}\n")
        super().error(message)

    def exit_for_the_job(self, status: int, message: str):
        """Exit on an error that every rank of a torchrun job meets alike: on a rank other than 0,
        silent while rank 0 says it and ends the job (harness.execute.launch.let_rank_0_say); if the
        job goes on nevertheless, the error is this rank's own: said, with the rank."""
        if a_torchrun_rank_but_0():
            try:
                let_rank_0_say()
            except KeyboardInterrupt:  # the job's Ctrl-C: rank 0 says it
                sys.exit(status)
            message = f"rank {os.environ['RANK']}: {message}"
        self.exit(status, message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m harness", description="FSDP equivalence harness")
    sub = p.add_subparsers(dest="verb", required=True)

    run = sub.add_parser(
        "run",
        help=f"run the matrix, write the report; exit {EXIT_OK} PASS, {EXIT_FAILED} FAIL, "
        f"{EXIT_USAGE} bad input, {EXIT_NOT_RUN} NOT RUN",
        epilog=EXIT_STATUSES,
    )
    opt.add_matrix_arguments(run.add_argument)
    opt.add_output_arguments(run.add_argument)
    run.add_argument("--json", action="store_true", help="print verdicts as JSON on stdout")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    opt.add_gate_arguments(run.add_argument)

    rep = sub.add_parser("report", help="re-render a report from a run's stored tables")
    rep.add_argument("tables_dir", type=Path, help="the <report>_tables directory a run wrote")
    rep.add_argument("--report", type=opt.report_path, default=None, help="output path (default: beside the tables)")

    plan = sub.add_parser("plan", help="memory-only per-rank state at large world sizes (fake process group)")
    plan.add_argument("--model", type=opt.models, default=("gpt2_medium",), help="model zoo name (default gpt2_medium)")
    plan.add_argument("--impl", dest="impls", type=opt.impls, default=opt.DEFAULT_IMPLS)
    plan.add_argument("--world-sizes", type=opt.world_sizes, default=(1, 2, 4, 8, 16, 32, 64))
    plan.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    opt.add_allow_large(plan.add_argument)

    loc = sub.add_parser(
        "localize",
        help="replay one scenario and its yardstick with every op traced on every "
        "rank and name where they first parted; exit 0 none beyond rounding, "
        "1 a divergence, 2 bad input",
    )
    loc.add_argument(
        "scenario",
        help="a scenario id, as the report and the console name it (e.g. fsdp_impl-mlp-ws4-split-adamw-clip)",
    )
    loc.add_argument("--steps", type=opt.steps, default=10, help="the run's training steps (default 10)")
    loc.add_argument("--lr", type=opt.positive_float, default=1e-2, help="the run's learning rate (default 1e-2)")
    loc.add_argument("--global-batch", type=opt.positive_int, default=16, help="the run's global batch (default 16)")
    loc.add_argument(
        "--up-to",
        type=opt.positive_int,
        default=None,
        metavar="STEP",
        help="trace the steps up to this one only (default: every step)",
    )
    loc.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    loc.add_argument(
        "--scenario-timeout",
        type=opt.timeout_seconds,
        default=300.0,
        help="seconds before a replayed run counts as hung (default 300)",
    )
    opt.add_allow_large(loc.add_argument)

    cmp_ = sub.add_parser(
        "compare",
        help="compare a stored run with a baseline or with another stored run (the same comparison as --baseline)",
    )
    cmp_.add_argument("tables_dir", type=Path, help="the <report>_tables directory of a run")
    cmp_.add_argument("other", help="a baseline name/path, or another run's _tables directory")
    cmp_.add_argument("--gate", type=opt.gate_spec, default=None, help="per-field tolerances")
    cmp_.add_argument("--gate-strict", action="store_true", help="exit 1 when nothing was compared")
    cmp_.add_argument("--json", action="store_true", help="print the comparison as JSON records")
    p.verbs = {"run": run, "report": rep, "plan": plan, "localize": loc, "compare": cmp_}
    return p


def _not_repeated(verb: argparse.ArgumentParser, args: list[str]) -> None:
    """An option of `verb` that takes a value, given twice, is a usage error (harness/options.py
    [Note: an option given twice]); argparse reads a unique prefix as the option, and so does this."""
    long = [s for a in verb._actions for s in a.option_strings if s.startswith("--")]
    takes_value = [s for a in verb._actions for s in a.option_strings if s.startswith("--") and a.nargs != 0]
    name = opt.repeated_option(args, takes_value, long)
    if name is not None:
        listed = any(name in a.option_strings and a.type in opt.LIST_TYPES for a in verb._actions)
        verb.error(str(opt.repeated_error(name, listed)))


def cmd_run(ns) -> int:
    opt.matrix_from(ns)  # cross-option errors first: torch is not loaded yet
    under_torchrun = launched_by_torchrun()
    quiet = ns.quiet or (under_torchrun and int(os.environ.get("RANK", "0")) != 0)

    def say(line: str) -> None:  # after each scenario and phase: a Ctrl-C that something swallowed ends it here
        interrupt.check()
        if not quiet:
            _stderr(line)

    stop = None if under_torchrun else _start_worlds_early()
    try:  # the models and user objects checked while the worlds' forkserver imports its preload
        session = Session(session_options(ns), say=say, under_torchrun=under_torchrun)
    except BaseException:
        if stop is not None:
            stop()  # no world will start: the server, maybe still importing, goes with this process
        raise
    if session.run() is None:  # a torchrun rank other than 0: rank 0 writes and decides
        return EXIT_OK
    interrupt.check()  # nothing is written for a run that a Ctrl-C ended
    status = session.finish()
    if ns.json:
        print(json.dumps([v.as_dict() for v in session.result.verdicts], indent=1, default=str))
    for v in session.failures():
        sys.stderr.write(f"{v}\n")
    sys.stderr.write(session.summary_line() + "\n")
    return status


def _start_worlds_early():
    """Start the forkserver the run's worlds come from (its preload imported meanwhile: the first progress line is
    then the first world's start plus its first scenario, not the imports too); the function that stops it."""
    from harness.execute import executor  # noqa: F401  (what the worlds' workers import: its preload)
    from harness.execute.world import start_forkserver, stop_forkserver

    start_forkserver()
    return stop_forkserver


def cmd_report(ns) -> int:
    from harness.report.markdown import write_report
    from harness.tables.store import load_tables

    tables, env = load_tables(ns.tables_dir)
    load_report_sections()
    out = ns.report or ns.tables_dir.with_name(ns.tables_dir.name.removesuffix("_tables") + ".md")
    print(write_report(tables, env, out))
    return EXIT_OK


def cmd_plan(ns) -> int:
    from harness.plan.table import format_plan, plan_table

    if not ns.allow_large:
        from harness.limits import check_plan_world_sizes, model_size

        for model in ns.model:
            check_plan_world_sizes(model, ns.world_sizes, model_size(model))
    from harness.plan.table import PlanError

    for model in ns.model:
        try:
            table = plan_table(model, ns.impls, ns.world_sizes, ns.optimizer)
        except PlanError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        print(f"## {model}: per-rank state, {ns.optimizer}\n")
        print(format_plan(table) + "\n")
    return EXIT_OK


def cmd_localize(ns) -> int:
    """The localiser on one scenario (harness.localize), its id held to what `run` holds its options to
    (harness.preflight.checked_scenario) before anything starts, and a line saying what it starts."""
    from harness.core.outcome import error_line
    from harness.execute.world import WorldError
    from harness.localize.replay import localize, scenario_of_id
    from harness.preflight import checked_scenario

    try:
        sc = scenario_of_id(ns.scenario, steps=ns.steps, lr=ns.lr, global_batch=ns.global_batch, backend=ns.backend)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if ns.up_to is not None and ns.up_to > ns.steps:
        raise argparse.ArgumentTypeError(f"--up-to {ns.up_to}: the run has {ns.steps} steps (--steps)")
    checked_scenario(sc, allow_large=bool(ns.allow_large))
    last = ns.up_to or ns.steps
    _stderr(
        f"localising {sc.id}: it and its yardstick replayed in worlds of up to {sc.world_size} ranks, every op "
        f"traced, steps 1-{last}"
    )
    try:
        found = localize(sc, steps=ns.up_to, timeout_s=ns.scenario_timeout)
    except WorldError as e:  # the run under test, or its yardstick, raised or hung: the rank's own line
        _stderr(f"error: the replay of {sc.id} did not run to its end: {error_line(str(e))}")
        return EXIT_FAILED
    print("\n".join(found.lines()))
    return EXIT_FAILED if found.diverged else EXIT_OK


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def cmd_compare(ns) -> int:
    """The gate's own comparison (harness.gate.compare.comparison), shown as a table."""
    from harness.core.environment import machine_kind
    from harness.gate.baseline import baseline_of_run, load_baseline
    from harness.gate.compare import compare_table
    from harness.tables.store import load_tables

    tables, env = load_tables(ns.tables_dir)
    other = Path(ns.other)
    if other.is_dir():
        base_tables, base_env = load_tables(other)
        base = baseline_of_run(base_tables, base_env, other.name, other)
    else:  # by name: the file of the stored run's machine kind, as the gate picks it
        base = load_baseline(ns.other, kind=machine_kind(env))
    table = compare_table(tables, base, ns.gate, env=env, strict=ns.gate_strict)
    if ns.json:
        print(table.to_json(orient="records", indent=1))
    else:
        print(table.to_markdown(index=False))
    failed = int((table["status"] == "fail").sum())
    sys.stderr.write(f"{failed} field(s) outside tolerance\n")
    return EXIT_FAILED if failed else EXIT_OK


def main(argv=None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        _not_repeated(parser.verbs[ns.verb], sys.argv[1:] if argv is None else list(argv))
        interrupt.check()  # a Ctrl-C that an option's parser swallowed (one that imports a user's module)
        return {
            "run": cmd_run,
            "report": cmd_report,
            "compare": cmd_compare,
            "plan": cmd_plan,
            "localize": cmd_localize,
        }[ns.verb](ns)
    except SystemExit:
        raise  # argparse's own exits (--help, usage errors), before the clauses below import anything
    except KeyboardInterrupt:
        return interrupt.said()
    except NotLaunchedHere as e:  # no job: said at once
        parser.exit(EXIT_USAGE, f"error: {e}\n")
    except argparse.ArgumentTypeError as e:
        parser.exit_for_the_job(EXIT_USAGE, f"error: {e}\n")
    except _input_errors() as e:
        parser.exit_for_the_job(EXIT_USAGE, f"error: {e}\n")
    except _output_errors() as e:  # a full disk, no permission: one line, the earlier outputs left in place
        parser.exit(EXIT_FAILED, f"error: {e}\n")


def _output_errors() -> tuple[type[BaseException], ...]:
    """Writes that fail (a report, or the run's temp dir filling up during the run): one line, exit 1."""
    from harness.core.scratch import ScratchError
    from harness.tables.store import OutputError

    return (OutputError, ScratchError)


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input files (a corrupt baseline or stored run): one line, exit 2."""
    from harness.gate.baseline import BaselineError
    from harness.tables.store import StoreError

    return (BaselineError, StoreError)


if __name__ == "__main__":
    sys.exit(main())
