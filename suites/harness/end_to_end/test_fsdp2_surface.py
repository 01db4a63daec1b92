"""More of FSDP2's surface as the matrix selects it: an integer reshard_after_forward (feature reshard2: after
its forward each unit is resharded to groups of 2 ranks, backward regathers within them), and a custom shard
placement (feature shard1: Shard(1) wherever dim 1 divides evenly, tinylm, W 1, 2: the tests below; 4 ranks,
where its 86-wide matrix stays Shard(0) beside Shard(1) ones in one unit, in suites/fsdp_impl/test_training.py and
`python -m harness run --features shard1 --models tinylm`). fsdp_impl and FSDP2
run it at 1 and 4 ranks (replicated data, AdamW, 3 steps, mlp; at 2 ranks it is the plain step) and train like the plain model, with the
traffic and memory the option promises: at 4 ranks backward's all-gathers run over groups of 2 ranks, and
forward's alone over all 4. DDP has no such wrap: its cells are unsupported, named. The mutants
post_forward_full_reshard and post_forward_kept_gathered (suites/mutants/) are caught in these cells only, as
columns_as_rows is in shard1's."""

from __future__ import annotations

import pytest

from harness.core.scenario import REFERENCE_IMPL, build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

IMPLS = ("fsdp_impl", "torch_fsdp2", "ddp")


@pytest.fixture(scope="module")
def ci_run():
    scenarios = build_matrix(IMPLS, ["mlp"], [1, 4], ("replicated",), ("adamw",), steps=3, features=("reshard2",))
    return scenarios, run_matrix(scenarios)


def test_fsdp_impl_and_fsdp2_reshard_to_a_smaller_group_and_train_like_the_plain_model(ci_run):
    scenarios, res = ci_run
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    ran = {v.scenario for v in res.verdicts if v.check == "completed" and v.status == PASS}
    mine = {s.id for s in scenarios if s.impl in ("fsdp_impl", "torch_fsdp2")}
    assert mine <= ran
    for check in ("ws1_exact", "cross_ws_replicated", "comm_volume", "units_gathered", "peak_params_bound"):
        held = {v.scenario for v in res.verdicts if v.check == check and v.status == PASS}
        assert held & mine, f"{check} held no reshard2 cell"


def test_backward_regathers_within_groups_of_two_at_four_ranks(ci_run):
    """The comm table's group sizes: at W = 4 each implementation all-gathers over 4 ranks (forward) and over
    2 (backward's regather) alike, P each, and reduces over all 4."""
    _, res = ci_run
    comm, sc = res.tables["comm"], res.tables["scenarios"]
    for impl in ("fsdp_impl", "torch_fsdp2"):
        row = sc[(sc.impl == impl) & (sc.world_size == 4)].iloc[0]
        c = comm[(comm.scenario == row.scenario) & (comm.collective == "all_gather")]
        by_ranks = c.groupby("ranks").elements.sum().to_dict()
        assert set(by_ranks) == {2, 4}, by_ranks
        p = float(row.param_elements)
        assert p <= by_ranks[4] < 2 * p and p <= by_ranks[2] < 2 * p, (impl, by_ranks, p)


def test_an_adapter_without_the_wrap_is_unsupported_by_name(ci_run):
    scenarios, res = ci_run
    ddp = [v for v in res.verdicts if v.scenario.startswith("ddp-")]
    assert ddp and all(v.status != PASS for v in ddp)
    assert any("wrap_reshard_after_forward" in v.message for v in ddp)


@pytest.fixture(scope="module")
def placed_run():
    scenarios = build_matrix(
        ("fsdp_impl", "torch_fsdp2"), ["tinylm"], [1, 2], ("replicated",), ("adamw",), steps=3, features=("shard1",)
    )
    return scenarios, run_matrix(scenarios)


def test_fsdp_impl_and_fsdp2_shard_on_dim_1_and_train_like_the_plain_model(placed_run):
    """At 2 ranks every tinylm matrix goes Shard(1) (its embedding included); both implementations pass every
    check at 1 and 2 ranks."""
    scenarios, res = placed_run
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    ran = {v.scenario for v in res.verdicts if v.check == "completed" and v.status == PASS}
    assert {s.id for s in scenarios if s.impl != REFERENCE_IMPL} <= ran


def test_the_placement_asks_for_dim_1_only_where_it_divides():
    import torch

    from harness.train.features import dim1_placement
    from harness.train.models import get_model_spec

    model = get_model_spec("tinylm").build()
    placed = {w: {n for n, p in model.named_parameters() if dim1_placement(w)(p) is not None} for w in (2, 4)}
    assert "blocks.0.mlp.w2.weight" in placed[2] - placed[4] and "blocks.0.attn.wq.weight" in placed[4]
    assert not any(p.dim() < 2 for n, p in model.named_parameters() if n in placed[2])
    assert dim1_placement(4)(torch.nn.Parameter(torch.zeros(3, 13))) is None
