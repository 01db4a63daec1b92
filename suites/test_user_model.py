"""The user's own model under the harness (`--models package.module:factory`): the example model
(suites/unit/example_model.py) trains equivalently under fsdp_impl and FSDP2, plain and with a
feature, and a model that breaks the protocol fails its scenarios with one line naming the problem."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL
from harness.execute.executor import run_matrix
from harness.train.models import get_model_spec
from harness.train.user_models import ModelError, check_batch, check_built, load_user_model

EXAMPLE = "suites.unit.example_model:spec"


@pytest.fixture(scope="module")
def worlds():
    from harness.execute.world import WorldPool

    pool = WorldPool()
    yield pool
    pool.close()


def test_the_example_model_passes_every_check_sharded(worlds):
    scenarios = build_matrix(["fsdp_impl", "torch_fsdp2"], [EXAMPLE], [1, 2], ("replicated", "split"), ("adamw",),
                             steps=3, features=("plain", "accum"))
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
        load_user_model("suites.unit.example_model:")


def test_a_factory_object_and_a_namespace_both_count(monkeypatch):
    import suites.unit.example_model as ex

    monkeypatch.setattr(ex, "as_namespace", SimpleNamespace(build=ex.TinyConvNet, make_batch=ex.make_batch,
                                                            loss=ex.F.cross_entropy, units=lambda m: list(m.blocks)),
                        raising=False)
    monkeypatch.setattr(ex, "factory", lambda: ex.spec, raising=False)
    for name in ("suites.unit.example_model:as_namespace", "suites.unit.example_model:factory"):
        assert load_user_model(name).name == name
