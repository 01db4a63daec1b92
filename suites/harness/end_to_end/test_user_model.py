"""The user's own model under the harness (`--models package.module:factory`): the example model
(suites/harness/unit/example_model.py) trains equivalently under fsdp_impl and FSDP2, plain and with a
feature, and a model that breaks the protocol fails its scenarios with one line naming the problem."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL
from harness.phases import run_matrix
from harness.train.models import get_model_spec
from harness.train.user_models import (
    LOSS_MEAN_RTOL,
    ModelError,
    check_batch,
    check_built,
    check_model,
    load_user_model,
    mean_loss_gap,
)

EXAMPLE = "suites.harness.unit.example_model:spec"


@pytest.fixture(scope="module")
def worlds(kept_worlds):
    return kept_worlds


@pytest.mark.parametrize("feature", ["plain", pytest.param("accum", marks=pytest.mark.ci)])  # accum: the CI tier's
def test_the_example_model_passes_every_check_sharded(worlds, feature):
    scenarios = build_matrix(
        ["fsdp_impl", "torch_fsdp2"],
        [EXAMPLE],
        [1, 2],
        ("replicated", "split"),
        ("adamw",),
        steps=3,
        features=(feature,),
    )
    res = run_matrix(scenarios, pool=worlds)
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    assert {v.scenario for v in res.verdicts} >= {s.id for s in scenarios}
    assert all("." in s.id.split("-ws")[0] and ":" not in s.id for s in scenarios)  # path-safe ids


def test_a_user_model_is_found_by_name_and_held_to_the_protocol():
    spec = get_model_spec(EXAMPLE)
    torch.manual_seed(0)
    model = spec.build()
    check_built(EXAMPLE, model, spec.units(model))
    check_batch(EXAMPLE, spec.make_batch(4, 1, 0), 4)
    with pytest.raises(ModelError, match="not submodules of the model"):
        check_built(EXAMPLE, model, [torch.nn.Linear(2, 2)])
    with pytest.raises(ModelError, match="build\\(\\) returned NoneType, not an nn.Module"):
        check_built(EXAMPLE, None, [])
    with pytest.raises(ModelError, match="returned 3 inputs and 4 targets; both must hold 4 samples"):
        check_batch(EXAMPLE, (torch.zeros(3, 2), torch.zeros(4)), 4)
    with pytest.raises(ModelError, match="expected 'package.module:factory'"):
        load_user_model("suites.harness.unit.example_model:")


def test_a_factory_object_and_a_namespace_both_count(monkeypatch):
    import suites.harness.unit.example_model as ex

    monkeypatch.setattr(
        ex,
        "as_namespace",
        SimpleNamespace(
            build=ex.TinyConvNet, make_batch=ex.make_batch, loss=ex.F.cross_entropy, units=lambda m: list(m.blocks)
        ),
        raising=False,
    )
    monkeypatch.setattr(ex, "factory", lambda: ex.spec, raising=False)
    for name in ("suites.harness.unit.example_model:as_namespace", "suites.harness.unit.example_model:factory"):
        assert load_user_model(name).name == name


# -- the protocol, held once in the parent before any world starts (harness.preflight) -------------

PROTOCOL_PROBLEMS = {
    "sum_loss": "is 2.000x the mean of its two halves' losses (a sum over the samples: reduction='sum'?)",
    "build_returns_none": "build() returned NoneType, not an nn.Module",
    "units_not_submodules": "units(model) returned Linear, which are not submodules of the model",
    "batch_one_short": "make_batch(16, ...) returned 15 inputs and 15 targets; both must hold 16 samples",
    "forward_raises": "loss(model(inputs), targets) raised RuntimeError: ",
}


@pytest.mark.parametrize("bad", sorted(PROTOCOL_PROBLEMS))
def test_a_model_that_breaks_the_protocol_is_named_before_anything_runs(bad):
    from suites.faults import bad_models

    with pytest.raises(ModelError) as err:
        check_model(getattr(bad_models, bad), 16, 0)
    assert PROTOCOL_PROBLEMS[bad] in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["mlp", "mlp_frozen", "tinylm", "tinylm_tied", EXAMPLE, "hf:gpt2", "hf:llama"])
def test_the_harness_own_models_hold_the_protocol_with_the_loss_mean_far_inside_its_tolerance(name):
    """Each model's mean loss, read as the whole batch and as its halves, differs by rounding only:
    far below the tolerance, which a sum (a factor 2) exceeds by far."""
    spec = get_model_spec(name)
    check_model(spec, 16, 0)
    torch.manual_seed(0)
    gap, ratio = mean_loss_gap(name, spec.build(), spec.loss, spec.make_batch(16, 1, 0))
    assert gap < LOSS_MEAN_RTOL / 100 and ratio == pytest.approx(1, rel=LOSS_MEAN_RTOL)
    summed = lambda out, y: spec.loss(out, y) * y.shape[0]  # noqa: E731  the same loss as a sum
    gap, ratio = mean_loss_gap(name, spec.build(), summed, spec.make_batch(16, 1, 0))
    assert gap > 100 * LOSS_MEAN_RTOL and ratio == pytest.approx(2, rel=LOSS_MEAN_RTOL)


def test_batch_statistics_and_dropout_do_not_read_as_a_loss_that_is_not_a_mean():
    """In training mode a BatchNorm's loss on a half is not that of the whole batch, and dropout draws
    anew per call; the loss check runs the model in eval mode, where neither mixes samples (a dropout that
    draws in training is refused before it, by check_no_random_forward: suites/harness/unit/test_loop_models.py)."""
    from suites.harness.unit.example_model import make_batch

    class Normed(torch.nn.Module):
        def __init__(self, p=0.0):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                [torch.nn.Sequential(torch.nn.Conv1d(3, 8, 3), torch.nn.BatchNorm1d(8), torch.nn.Dropout(p))]
            )
            self.head = torch.nn.Linear(80, 5)

        def forward(self, x):
            return self.head(self.blocks[0](x).flatten(1))

    spec = SimpleNamespace(
        name="normed",
        build=Normed,
        make_batch=make_batch,
        loss=torch.nn.functional.cross_entropy,
        units=lambda m: list(m.blocks),
    )
    check_model(spec, 16, 0)
    model = Normed(p=0.5)
    assert model.training  # the check leaves the mode as it found it
    gap, _ = mean_loss_gap("normed", model, spec.loss, make_batch(16, 1, 0))
    assert gap < LOSS_MEAN_RTOL and model.training
