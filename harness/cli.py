"""Command line: `python -m harness run|report|compare ...` (also installed as `fsdp-harness`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import options as opt

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness", description="FSDP equivalence harness")
    sub = p.add_subparsers(dest="verb", required=True)

    run = sub.add_parser("run", help="run the matrix, write the report, exit 1 on any failed verdict")
    opt.add_matrix_arguments(run.add_argument)
    run.add_argument("--report", type=opt.report_path, default=opt.DEFAULT_REPORT, help="markdown report path")
    run.add_argument("--json", action="store_true", help="print verdicts as JSON on stdout")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--per-sample", action="store_true",
                     help="also check per-sample gradient norms (DP-SGD) at the same world sizes (mlp; Opacus if installed)")
    opt.add_gate_arguments(run.add_argument)

    rep = sub.add_parser("report", help="re-render a report from a run's stored tables")
    rep.add_argument("tables_dir", type=Path, help="the <report>_tables directory a run wrote")
    rep.add_argument("--report", type=opt.report_path, default=None, help="output path (default: beside the tables)")

    plan = sub.add_parser("plan", help="memory-only per-rank state at large world sizes (fake process group)")
    plan.add_argument("--model", type=opt.models, default=("gpt2_medium",), help="model zoo name (default gpt2_medium)")
    plan.add_argument("--impl", dest="impls", type=opt.impls, default=opt.DEFAULT_IMPLS)
    plan.add_argument("--world-sizes", type=opt.world_sizes, default=(1, 2, 4, 8, 16, 32, 64))
    plan.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")

    cmp_ = sub.add_parser("compare", help="compare a stored run with a baseline or with another stored run")
    cmp_.add_argument("tables_dir", type=Path, help="the <report>_tables directory of a run")
    cmp_.add_argument("other", help="a baseline name/path, or another run's _tables directory")
    cmp_.add_argument("--gate", type=opt.gate_spec, default=None, help="per-field tolerances")
    cmp_.add_argument("--json", action="store_true", help="print the comparison as JSON records")
    return p


def _tables_dir(report: Path) -> Path:
    return report.with_name(f"{report.stem}_tables")


def cmd_run(ns) -> int:
    from .report import write_report
    from .store import save_run
    from .worker import launched_by_torchrun
    m = opt.matrix_from(ns)
    under_torchrun = launched_by_torchrun()
    if under_torchrun and ns.per_sample:
        raise argparse.ArgumentTypeError("--per-sample is not available under torchrun yet; run it without "
                                          "torchrun (python -m harness run --per-sample ...)")
    baseline = opt.load_baseline_option(ns.baseline, ns.gate)
    scenarios = m.scenarios()
    err = sys.stderr
    quiet = ns.quiet or (under_torchrun and int(os.environ.get("RANK", "0")) != 0)

    def progress(i, n, sc, secs):
        if not quiet:
            err.write(f"[{i:>3}/{n}] {sc.id:<48} {secs:6.1f}s\n")
            err.flush()

    if not quiet:
        where = "this torchrun job" if under_torchrun else "worlds"
        err.write(f"running {len(scenarios)} scenarios in {where} of {','.join(map(str, m.world_sizes))} ranks\n")
    if under_torchrun:
        from .torchrun import run_matrix_under_torchrun
        res = run_matrix_under_torchrun(scenarios, timeout_s=m.timeout_s, bounds=m.bounds, progress=progress)
        if res is None:  # not rank 0: rank 0 writes the report and decides the exit status
            return EXIT_OK
    else:
        from .run import run_matrix
        res = run_matrix(scenarios, timeout_s=m.timeout_s, bounds=m.bounds, progress=progress)
    if ns.per_sample:
        from .run import add_per_sample
        if not ns.quiet:
            err.write("per-sample gradient norms ...\n")
        add_per_sample(res, m.world_sizes)
    if baseline is not None:
        from .run import apply_gate
        apply_gate(res, baseline, ns.gate)
    if ns.save_baseline:
        from .baseline import save_baseline
        err.write(f"baseline written: {save_baseline(res.tables, res.env, ns.save_baseline)}\n")
    save_run(res.tables, res.env, _tables_dir(ns.report))
    path = write_report(res.tables, res.env, ns.report)
    counts = {s: sum(v.status == s for v in res.verdicts) for s in ("pass", "fail", "known", "skip")}
    if ns.json:
        print(json.dumps([v.as_dict() for v in res.verdicts], indent=1, default=str))
    for v in res.failed:
        err.write(f"{v}\n")
    err.write(f"{counts['pass']} passed, {counts['fail']} failed, {counts['known']} known deviations, "
              f"{counts['skip']} skipped in {res.wall_s:.1f}s; report: {path}\n")
    return EXIT_FAILED if counts["fail"] else EXIT_OK


def cmd_report(ns) -> int:
    from .report import write_report
    from .store import load_run
    tables, env = load_run(ns.tables_dir)
    out = ns.report or ns.tables_dir.with_name(ns.tables_dir.name.removesuffix("_tables") + ".md")
    print(write_report(tables, env, out))
    return EXIT_OK


def cmd_plan(ns) -> int:
    from .planning import format_plan, plan_table
    for model in ns.model:
        print(f"## {model}: per-rank state, {ns.optimizer}\n")
        print(format_plan(plan_table(model, ns.impls, ns.world_sizes, ns.optimizer)) + "\n")
    return EXIT_OK


def cmd_compare(ns) -> int:
    from .baseline import compare_table, load_baseline
    from .store import load_run
    tables, _ = load_run(ns.tables_dir)
    other = load_run(Path(ns.other))[0] if Path(ns.other).is_dir() else load_baseline(ns.other)
    table = compare_table(tables, other, ns.gate)
    if ns.json:
        print(table.to_json(orient="records", indent=1))
    else:
        print(table.to_markdown(index=False))
    failed = int((table["status"] == "fail").sum()) if "status" in table else 0
    sys.stderr.write(f"{failed} field(s) outside tolerance\n")
    return EXIT_FAILED if failed else EXIT_OK


def main(argv=None) -> int:
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
        return {"run": cmd_run, "report": cmd_report, "compare": cmd_compare, "plan": cmd_plan}[ns.verb](ns)
    except (SystemExit, KeyboardInterrupt) as e:
        if isinstance(e, SystemExit):
            raise  # argparse's own exits (--help, usage errors)
        sys.stderr.write("interrupted\n")
        return 130
    except argparse.ArgumentTypeError as e:
        parser.exit(EXIT_USAGE, f"error: {e}\n")
    except _input_errors() as e:
        parser.exit(EXIT_USAGE, f"error: {e}\n")


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input files (a corrupt baseline or stored run): one line, exit 2."""
    from .baseline import BaselineError
    from .store import StoreError
    return (BaselineError, StoreError)


if __name__ == "__main__":
    sys.exit(main())
