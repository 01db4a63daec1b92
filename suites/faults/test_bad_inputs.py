"""Bad input to `python -m harness run` and to the pytest plugin: one clear line and a usage exit.

The cases and the probe that runs them are in ``bad_inputs.py``; the module-scoped
``bad_input_outcomes`` runs them all once for every test here.
"""

from __future__ import annotations

import re

import pytest

from reports import bad_inputs as table
from suites.faults import bad_inputs

# the CI tier (--ci; .ci/run runs it): every bad input through the CLI and pytest, each a process
pytestmark = pytest.mark.ci


@pytest.fixture(scope="module")
def bad_input_outcomes():
    return {(o.case, o.mode): o for o in bad_inputs.probe_all()}


def _bad_input_params():
    for case in bad_inputs.CASES:
        for mode in ("cli", "pytest") if case.pytest else ("cli",):
            yield pytest.param(case, mode, id=f"{mode}-" + re.sub(r"\W+", "_", case.what).strip("_"))


@pytest.mark.parametrize("case, mode", list(_bad_input_params()))
def test_bad_input_gets_one_clear_line_and_a_usage_exit(bad_input_outcomes, case, mode):
    o = bad_input_outcomes[(case, mode)]
    expected_rc = bad_inputs.CLI_USAGE_EXIT if mode == "cli" else bad_inputs.PYTEST_USAGE_EXIT
    assert not o.traceback, o.output
    assert o.rc == expected_rc, o.output
    assert len(o.lines) == 1, o.output
    assert case.expect in o.lines[0]
    if mode == "pytest" and ": error: " in o.lines[0]:  # argparse names the command the user typed
        assert o.lines[0].startswith("python -m pytest: error: "), o.lines[0]


def test_the_committed_bad_input_table_is_what_the_cli_prints_now(bad_input_outcomes):
    """reports/bad_inputs.md, regenerated from this run's probes, reads the same (the numbers of
    this machine's figures aside): a message that changed, or a case added, makes it stale."""
    now = table.render(list(bad_input_outcomes.values()))
    committed = table.TABLE.read_text(encoding="utf-8")
    assert table.stable(committed) == table.stable(now), (
        "reports/bad_inputs.md is stale: rerun python -m reports.bad_inputs"
    )


# one case each way that gets past argparse and imports torch: the part a fork skips
FRESH_TWINS = [
    ("user model whose loss is a sum over the batch", "cli"),
    ("user optimizer factory returning the wrong thing", "pytest"),
]


@pytest.mark.parametrize("what, mode", FRESH_TWINS, ids=[m for _, m in FRESH_TWINS])
def test_a_forked_probe_prints_what_a_fresh_process_prints(bad_input_outcomes, what, mode):
    """The probes run forked from a process that imported torch (bad_inputs.probe_forked): the same
    case in a fresh interpreter gives the same exit status and every byte of the same output."""
    case = next(c for c in bad_inputs.CASES if c.what == what)
    forked, fresh = bad_input_outcomes[(case, mode)], bad_inputs.probe(case, mode)
    assert (forked.rc, forked.output) == (fresh.rc, fresh.output)
