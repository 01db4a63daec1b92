"""pytest plugin: matrix options, one lazily-run matrix per session, a report at the end.

Registered by the `pytest11` entry point and by the root conftest.py. Tests reach the run
through the `harness_run` fixture; `scenario_ids(config)` lists the ids tests parametrize on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from . import options as opt

_RUN_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser):
    # argparse names the program after sys.argv[0]: under `python -m pytest` (the README's command)
    # that is pytest's "__main__.py", which tells the reader nothing in a usage error
    if parser.prog == "__main__.py":
        parser.prog = "python -m pytest"
    group = parser.getgroup("fsdp-harness", "FSDP equivalence harness")
    opt.add_matrix_arguments(lambda name, **kw: group.addoption(name, **kw))
    group.addoption("--report", type=opt.report_path, default=opt.DEFAULT_REPORT,
                    help=f"verification report written after the run (default {opt.DEFAULT_REPORT})")
    group.addoption("--no-report", action="store_true", help="do not write the report")
    opt.add_gate_arguments(lambda name, **kw: group.addoption(name, **kw))
    group.addoption("--slow", action="store_true", help="also run tests marked slow")


def pytest_configure(config):
    try:
        config.stash[_RUN_KEY] = {"matrix": opt.matrix_from(config.option), "result": None,
                                  "baseline": opt.load_baseline_option(config.getoption("--baseline"),
                                                                           config.getoption("--gate"))}
    except argparse.ArgumentTypeError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow tier: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def matrix_options(config) -> opt.MatrixOptions:
    return config.stash[_RUN_KEY]["matrix"]


def get_run(config):
    """Run the matrix once per session (lazily, on first use) and return the RunResult."""
    state = config.stash[_RUN_KEY]
    if state["result"] is None:
        from .run import run_matrix
        m = state["matrix"]
        scenarios = m.scenarios()
        _say(config, f"\n[fsdp-harness] running {len(scenarios)} scenarios "
                     f"(world sizes {','.join(map(str, m.world_sizes))})")
        progress = lambda i, n, sc, secs: _say(config, f"[fsdp-harness] {i:>3}/{n} {sc.id:<48} {secs:5.1f}s")  # noqa: E731
        result = run_matrix(scenarios, timeout_s=m.timeout_s, bounds=m.bounds, progress=progress)
        if state["baseline"] is not None:
            from .run import apply_gate
            apply_gate(result, state["baseline"], config.getoption("--gate"))
        state["result"] = result
    return state["result"]


def _say(config, line: str) -> None:
    """Progress on the terminal even while pytest captures output."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        sys.stderr.write(line + "\n")
        return
    with capman.global_and_fixture_disabled():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def harness_run(request):
    return get_run(request.config)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    state = config.stash.get(_RUN_KEY, None)
    if not state or state["result"] is None:
        return
    res = state["result"]
    if config.getoption("--save-baseline"):
        from .baseline import save_baseline
        _say(config, f"[fsdp-harness] baseline: {save_baseline(res.tables, res.env, config.getoption('--save-baseline'))}")
    if config.getoption("--no-report"):
        return
    from .report import write_report
    path = Path(config.getoption("--report"))
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        path = path.with_name(f"{path.stem}.{worker}{path.suffix}")
    _say(config, f"\n[fsdp-harness] report: {write_report(res.tables, res.env, path)}")
