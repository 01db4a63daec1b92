"""A run whose parameters do not move is a failure (`params_move`, harness/checks/rows.py): at a learning rate
too small for any update to change an fp32 value every check that compares runs compares nothing with nothing,
and passed. A frozen layer moving nothing in an ordinary run is no failure. The model is written for the tests
(suites/harness/unit/half_frozen_model.py)."""

from __future__ import annotations

import pytest

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

MODEL = "suites.harness.unit.half_frozen_model:spec"


def _run(pool, lr: float, optimizers=("adamw",)):
    scenarios = build_matrix(["fsdp_impl"], [MODEL], [1, 2], ("replicated", "split"), optimizers, steps=3, lr=lr)
    return scenarios, run_matrix(scenarios, pool=pool)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_run_that_trains_nothing_fails_params_move_in_every_scenario(kept_worlds, optimizer):
    scenarios, res = _run(kept_worlds, 1e-30, (optimizer,))
    for sc in scenarios:
        [v] = [v for v in res.verdicts if v.scenario == sc.id and v.check == "params_move"]
        assert (v.status, v.step) == (FAIL, sc.steps), str(v)


def test_an_ordinary_run_with_a_frozen_layer_passes_params_move(kept_worlds):
    scenarios, res = _run(kept_worlds, 1e-2)
    moved = {v.scenario: v for v in res.verdicts if v.check == "params_move"}
    assert set(moved) == {sc.id for sc in scenarios}
    assert all(v.status == PASS for v in moved.values()), [str(v) for v in moved.values() if v.status != PASS]
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, failed
    # the frozen layer's two parameters are the ones that did not move
    assert all(int(v.measured) == 4 for v in moved.values()), [str(v) for v in moved.values()]
