"""The optimizer state a rank holds (harness/measure/optim_state.py) and a resumed run's against its
saver's across layouts (harness/tables/restored_state.py), the measurement behind ckpt_restored."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from harness.measure.optim_state import held_state, param_names
from harness.tables.restored_state import compare
from suites.fsdp_impl.worlds.common import shard_each_child

TASK = "suites.harness.unit.test_restored_state:hold"


def _rank(parts: dict, problems=()) -> dict:
    return {"state": parts, "problems": list(problems)}


def _rows(t: torch.Tensor, a: int, b: int) -> dict:
    return {"offset": (a,) + (0,) * (t.dim() - 1), "shape": tuple(t.shape), "local": t[a:b].clone()}


def _scalar(x: float) -> dict:
    return {"offset": (), "shape": (), "local": torch.tensor(x)}


def _cut(state: dict[str, torch.Tensor], cuts: list[tuple[int, int]], step: float = 3.0) -> list[dict]:
    """Every rank's parts of `state` ("w": a 5 x 2 exp_avg) cut at `cuts`, each rank with the step."""
    return [_rank({"w": {"exp_avg": _rows(state["w"], a, b), "step": _scalar(step)}}) for a, b in cuts]


W = {"w": torch.arange(10, dtype=torch.float32).reshape(5, 2) / 7}
TWO, THREE = [(0, 3), (3, 5)], [(0, 2), (2, 4), (4, 5)]


def test_state_saved_at_one_layout_and_held_at_another_is_the_same_element_for_element():
    for saved, restored in ((TWO, THREE), (THREE, TWO), ([(0, 5)], TWO), (TWO, [(0, 5), (0, 5)])):  # the last: DDP
        got = compare(_cut(W, saved), _cut(W, restored))
        assert got["state_restore_diff"] == 0.0 and not got["state_restore_where"], got
        assert got["state_restored"].startswith("exp_avg, step of 1 parameters")


def test_a_misplaced_element_is_named_with_its_parameter_key_index_rank_and_values():
    restored = _cut(W, THREE)
    restored[2]["state"]["w"]["exp_avg"]["local"][0, 1] = 5.0  # rank 2 holds row 4 of 5
    got = compare(_cut(W, TWO), restored)
    assert got["state_restore_diff"] == pytest.approx(5.0 - 9 / 7)
    assert (got["state_restore_param"], got["state_restore_rank"]) == ("w", 2)
    where = got["state_restore_where"]
    assert where.startswith("w exp_avg[4, 1] on rank 2: 5 after loading, 1.28571") and "(1 of" in where


def test_a_step_counter_left_at_zero_is_caught_alone():
    got = compare(_cut(W, TWO), _cut(W, THREE, step=0.0))
    assert got["state_restore_diff"] == 3.0
    assert "w step on rank 0: 0 after loading, 3 saved" in got["state_restore_where"]
    assert "3 of " in got["state_restore_where"]  # one step per loading rank


def test_state_missing_or_extra_after_loading_fails_as_missing_not_as_a_number():
    restored = _cut(W, THREE)
    restored[1]["state"]["w"]["exp_avg"] = _rows(W["w"], 2, 3)  # rows 3 of 5 held by no rank
    got = compare(_cut(W, TWO), restored)
    assert got["state_restore_diff"] == math.inf and "w exp_avg[3, 0]: held by no rank" in got["state_restore_where"]
    fresh = [_rank({}) for _ in THREE]  # an optimizer that loaded nothing
    got = compare(_cut(W, TWO), fresh)
    assert got["state_restore_diff"] == math.inf
    assert "saved, held by no rank after loading" in got["state_restore_where"]
    extra = _cut(W, THREE)
    extra[0]["state"]["w"]["exp_avg_sq"] = _rows(W["w"], 0, 2)
    assert "exp_avg_sq: held after loading, not saved" in compare(_cut(W, TWO), extra)["state_restore_where"]


def test_state_that_cannot_be_placed_is_not_measured():
    restored = [_rank({}, ["w exp_avg: a DTensor with placements (Partial(sum),): partial sums, not elements"])]
    got = compare(_cut(W, TWO), restored)
    assert math.isnan(got["state_restore_diff"]) and "partial sums" in got["state_restore_where"]


def test_held_state_reads_plain_tensors_as_whole_values_under_the_plain_models_names():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    held = held_state([opt], param_names(model))
    assert not held["problems"] and list(held["state"]) == [n for n, _ in model.named_parameters()]
    part = held["state"]["0.weight"]["exp_avg_sq"]
    assert part["offset"] == (0, 0) and part["shape"] == (3, 2)
    assert torch.equal(part["local"], opt.state[model[0].weight]["exp_avg_sq"])
    assert held["state"]["1.bias"]["step"]["offset"] == ()
    # a parameter the optimizer holds that the model does not name cannot be compared by name
    stray = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [stray]})
    stray.grad = torch.ones(2)
    opt.step()
    assert "not a parameter of the model" in held_state([opt], param_names(model))["problems"][0]
    # ... unless it belongs to an optimizer other than the adapter's own (another scenario's, say)
    assert not held_state([torch.optim.SGD([nn.Parameter(torch.ones(1))]), opt], param_names(model), own=0)["problems"]


def hold(ctx, impl: str) -> dict:
    """Train a 5-row Linear one AdamW step sharded by `impl` at this world size; this rank's held_state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    shard_each_child(model, ctx, impl)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    model(torch.arange(12.0).reshape(4, 3)).sum().backward()
    opt.step()
    return held_state([opt], param_names(model))


@pytest.mark.parametrize("impl", ["fsdp2", "fsdp_impl"])
def test_dtensor_state_at_two_ranks_is_placed_where_one_rank_holds_it(world, impl):
    """The same step at 1 and 2 ranks (replicated input, so the same numbers): each rank's DTensor
    parts put back at their offsets give the one-rank state; a part whose rows are swapped does not, and
    a part said to start a row early leaves the last row unheld."""
    one, two = world(1).call(TASK, impl), world(2).call(TASK, impl)
    assert not any(r["problems"] for r in one + two)
    assert two[1]["state"]["0.weight"]["exp_avg"]["offset"] == (3, 0)  # rows 3, 4 of 5 on rank 1
    got = compare(one, two)
    assert got["state_restore_diff"] == 0.0, got
    assert got["state_restored"].startswith("exp_avg, exp_avg_sq, step of 4 parameters")
    part = two[1]["state"]["0.weight"]["exp_avg"]
    part["local"] = part["local"].flip(0)
    got = compare(one, two)
    assert got["state_restore_param"] == "0.weight" and got["state_restore_rank"] == 1
    assert got["state_restore_where"].startswith("0.weight exp_avg[") and " on rank 1: " in got["state_restore_where"]
    part["local"], part["offset"] = part["local"].flip(0), (2, 0)
    got = compare(one, two)
    assert got["state_restore_diff"] == math.inf
    assert "0.weight exp_avg[4, 0]: held by no rank" in got["state_restore_where"]


def test_values_that_are_not_tensors_are_compared_as_values():
    saved = [_rank({"w": {"step": {"value": 3}}})]
    assert compare(saved, [_rank({"w": {"step": {"value": 3}}})] * 2)["state_restore_diff"] == 0.0
    assert compare(saved, [_rank({"w": {"step": _scalar(3.0)}})])["state_restore_diff"] == 0.0  # a tensor now
    got = compare(saved, [_rank({"w": {"step": {"value": 2}}})])
    assert got["state_restore_diff"] == 1.0
    assert got["state_restore_where"].startswith("w step on rank 0: 2 after loading, 3 saved")
    got = compare(saved, [_rank({"w": {"step": _rows(W["w"], 0, 5)}})])
    assert (
        got["state_restore_diff"] == math.inf
        and "holds a tensor of shape (5, 2) after loading" in got["state_restore_where"]
    )
