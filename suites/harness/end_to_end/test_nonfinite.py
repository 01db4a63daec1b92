"""A model that gives NaN or Inf is a failed `finite` verdict naming the step and the module where the first
non-finite value appeared (harness/train/nonfinite.py), never a loss-protocol error before the run
(harness/train/user_models.py mean_loss_gap), whatever the implementation. The models are written for these
tests (suites/harness/unit/nonfinite_models.py), each non-finite in one known place."""

from __future__ import annotations

import pytest

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL
from harness.phases import run_matrix
from harness.train.models import get_model_spec
from harness.train.nonfinite import LOSS
from harness.train.user_models import check_model

MODELS = "suites.harness.unit.nonfinite_models"
STEPS = 3
# model -> (the first step whose loss is not finite, the verdict's param: the module whose output was first
# non-finite, or LOSS where only the loss was)
EXPECTED = {
    f"{MODELS}:nan_in_middle": (1, "mid.gate"),
    f"{MODELS}:inf_input_at_step_3": (3, "first"),
    f"{MODELS}:nan_target_at_step_2": (2, "loss"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_non_finite_model_passes_the_preflight(name):
    """The preflight's loss check asks whether the loss is a mean; a NaN loss answers nothing about that."""
    check_model(get_model_spec(name), 16, 0)  # raises ModelError on a protocol breach


@pytest.fixture(scope="module")
def result(kept_worlds):
    scenarios = build_matrix(["fsdp_impl"], sorted(EXPECTED), [1, 2], ("replicated", "split"), ("adamw",), steps=STEPS)
    return scenarios, run_matrix(scenarios, pool=kept_worlds)


def test_every_scenario_fails_finite_at_the_step_and_module_of_the_first_non_finite_value(result):
    scenarios, res = result
    for sc in scenarios:
        step, param = EXPECTED[sc.model]
        finite = [v for v in res.verdicts if v.scenario == sc.id and v.check == "finite"]
        assert [(v.status, v.step, v.param) for v in finite] == [(FAIL, step, param)], [str(v) for v in finite]


def test_the_steps_table_records_where_only_at_the_first_non_finite_step(result):
    scenarios, res = result
    steps = res.tables["steps"]
    for sc in scenarios:
        step, param = EXPECTED[sc.model]
        rows = steps[steps.scenario == sc.id].sort_values("step")
        recorded = dict(zip(rows.step, rows.nonfinite_module.fillna("")))
        assert recorded == {k: (LOSS if param == "loss" else param) if k == step else "" for k in range(1, STEPS + 1)}


def test_a_non_finite_loss_the_plain_model_does_not_give_is_the_implementations(tmp_path):
    """A loss the run found non-finite where the plain model, at the run's own parameters, gives a finite one on
    the same batch: the implementation's step made it (nothing in the model to name)."""
    import torch

    from harness.train.nonfinite import NOT_REPRODUCED, first_nonfinite_module
    from harness.train.params_file import save_params

    name = f"{MODELS}:inf_input_at_step_3"
    spec = get_model_spec(name)
    sc = build_matrix(["fsdp_impl"], [name], [1], ("replicated",), ("adamw",), steps=STEPS)[0]
    torch.manual_seed(0)
    save_params(dict(spec.build().named_parameters()), tmp_path / "step1.pt")
    assert first_nonfinite_module(sc, spec, tmp_path, 2, torch.device("cpu")) == NOT_REPRODUCED
    save_params(dict(spec.build().named_parameters()), tmp_path / "step2.pt")
    assert first_nonfinite_module(sc, spec, tmp_path, 3, torch.device("cpu")) == "first"
