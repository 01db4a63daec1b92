"""`full_params` is held against the plain model's parameters, names and shapes, at every step.

Before this check, an adapter that left a parameter out passed every check (its diffs were never
computed); a wrong name or shape showed only as an unexplained `inf`, an empty dict as `nan`."""

from __future__ import annotations

import pytest
import torch

from harness.core.scenario import build_matrix
from harness.phases import run_matrix
from harness.train.models import get_model_spec

from .partial_adapters import DROPPED

MOD = "suites.harness.unit.partial_adapters"


@pytest.fixture(scope="module")
def result(kept_worlds):
    impls = [f"{MOD}:{n}" for n in ("leaves_one_out", "renames", "reshapes", "empty")] + ["fsdp_impl"]
    return run_matrix(build_matrix(impls, ["mlp"], [1, 2], ["replicated"], ["sgd"], steps=2), pool=kept_worlds)


def _coverage(result, name: str, ws: int):
    sid = next(s.id for s in result.scenarios if s.impl.endswith(name) and s.world_size == ws)
    return [v for v in result.verdicts if v.scenario == sid and v.check == "params_cover_model"]


def _plain_names() -> list[str]:
    torch.manual_seed(0)
    return [n for n, _ in get_model_spec("mlp").build().named_parameters()]


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize(
    "name, problem", [("leaves_one_out", "missing"), ("reshapes", "shape (1,"), ("renames", "missing")]
)
def test_a_misreported_parameter_fails_naming_it_at_step_1(result, name, problem, ws):
    assert DROPPED in _plain_names()
    [v] = _coverage(result, name, ws)
    assert v.status == "fail" and (v.step, v.param) == (1, DROPPED), str(v)
    assert problem in v.message and DROPPED in v.message


def test_a_renamed_parameter_is_also_named_as_unknown(result):
    [v] = _coverage(result, "renames", 1)
    assert "renamed_bias: not a parameter of the plain model" in v.message


def test_an_empty_dict_fails_listing_what_is_missing(result):
    [v] = _coverage(result, "empty", 2)
    assert v.status == "fail" and v.step == 1 and v.measured == len(_plain_names())
    assert "missing" in v.message


def test_a_correct_adapter_covers_every_parameter(result):
    [v] = _coverage(result, "fsdp_impl", 2)
    assert v.status == "pass" and f"all {len(_plain_names())} parameters" in v.message
