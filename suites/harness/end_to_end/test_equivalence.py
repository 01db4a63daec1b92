"""The equivalence matrix: one test per scenario, asserting every verdict about it.

The matrix comes from the command line (--world-sizes, --impl, --models, --data-modes, ...).
A verdict with status "known" (a documented deviation of a real implementation, harness/core/policy.py)
makes the test xfail with the measured value and the cause; any other failure fails the test. A
scenario whose implementation lacks what its feature needs was not run: the test is skipped with a
reason that starts "[UNSUPPORTED]".

Tiers: without --slow the matrix runs its first model, first optimizer and first seed (mlp and AdamW
by default) for every implementation, world size, data mode and feature: every check, every cell
shape. Every check applies whatever the model and optimizer, so the other models, optimizers and seeds
repeat the same checks on other numbers: they are the slow tier (--slow), and the main job
(`python -m harness run`) runs all of them. The slow tier's tests are skipped and their scenarios are
not run (harness/plugin.py runs only what the tests that run need).
"""

import pytest

from harness.plugin import matrix_options


def pytest_generate_tests(metafunc):
    if "scenario_id" in metafunc.fixturenames:
        m = matrix_options(metafunc.config)
        first = (m.models[0], m.optimizers[0], m.seeds[0])
        params = [
            pytest.param(s.id, id=s.id, marks=() if (s.model, s.optimizer, s.seed) == first else pytest.mark.slow)
            for s in m.scenarios()
        ]
        metafunc.parametrize("scenario_id", params)


def test_scenario(harness_run, scenario_id):
    verdicts = [v for v in harness_run.verdicts if v.scenario == scenario_id]
    assert verdicts, f"no verdict was produced for {scenario_id}"
    failed = [v for v in verdicts if v.status == "fail"]
    known = [v for v in verdicts if v.status == "known"]
    unsupported = [v for v in verdicts if v.status == "unsupported"]
    assert not failed, "\n".join(str(v) for v in failed)
    if known:
        pytest.xfail("; ".join(str(v) for v in known))
    if unsupported:  # not run: shown as a skip whose reason starts with UNSUPPORTED, never a pass
        pytest.skip("; ".join(str(v) for v in unsupported))
