"""fsdp_impl in real process worlds (gloo, CPU): sharding, wrapping, numerics, state dicts, meta init.

Every rank-side step lives in ``suites/fsdp_impl/worlds/``. One ``World`` per world size is
started once for this module and reused. References are the PLAIN model (no fsdp_impl code at
all) trained in the same kind of worker, or values computed here by hand; the code under test is
never compared with a second output of itself standing in for the truth. The classic-bug test
at the end shows that the cross-world-size comparison used throughout can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fsdp_impl.sharding import chunk_rows, row_range
from suites.fsdp_impl.worlds.common import plain_runs

TASKS = "suites.fsdp_impl.worlds"  # a package: tasks are named "<module>:<function>" in it
REPLICATED_BOUND = 3e-8  # max |param diff| across world sizes with replicated data (DESIGN.md)
SPLIT_BOUND = 1e-6  # split data vs full batch, 5 SGD steps at lr 0.05: fp32 rounding of sums only


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plain(world):
    """plain(payload) -> rank 0's result of training the PLAIN model (cached per payload)."""
    return plain_runs(world, f"{TASKS}.training:train")


def run(world, n: int, task: str, payload=None) -> list:
    return world(n).call(f"{TASKS}.{task}", payload)


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k], b[k]), f"{k}: max diff {np.max(np.abs(a[k] - b[k]))}"


MLP = {"model": "mlp", "batch": 8, "lr": 0.05}


# ----------------------------------------------------------------------------- shard layout


@pytest.mark.parametrize("n", [1, 2, 3])
def test_each_rank_holds_exactly_its_rows_as_a_dtensor(world, n):
    """Every parameter under its original name is a DTensor, Shard(0) over the group's mesh, of the
    original shape; rank r holds rows [r c, min((r + 1) c, R)) of the eagerly built value (c =
    ceil(R / n), cut here from the EAGER parameters); the padded shard is c rows, zero after its own."""
    results = run(world, n, "wrapping:layout", {"model": "mlp"})
    eager = results[0]["eager"]
    for r, got in enumerate(results):
        assert [q["name"] for q in got["params"]] == list(eager)  # the original names, in order
        for q in got["params"]:
            rows = eager[q["name"]].shape[0]
            start, end = row_range(rows, n, r)
            assert q["type"] == "DTensor" and q["placements"] == ["Shard(dim=0)"], q
            assert q["shape"] == eager[q["name"]].shape and q["mesh"] == list(range(n))
            assert q["local_shape"] == (end - start, *eager[q["name"]].shape[1:])
        for unit in got["units"]:
            for q in unit["params"]:
                name = f"{unit['prefix']}.{q['fqn']}" if unit["prefix"] else q["fqn"]
                full = eager[name]
                start, end = row_range(full.shape[0], n, r)
                assert np.array_equal(q["local"], full[start:end]), f"{name} rank {r}"
                row = int(np.prod(full.shape[1:]))
                assert q["padded_numel"] == chunk_rows(full.shape[0], n) * row
                assert not q["padding"].any()
    # nothing held twice: the ranks' rows add up to the parameters
    assert sum(got["numel_local"] for got in results) == sum(v.size for v in eager.values())


def test_uneven_rows_leave_a_rank_empty(world):
    """The mlp at 8 ranks: its 7-row output layer leaves rank 7 with no row, an empty local tensor
    in a DTensor of the full shape all the same; every other row is held exactly once."""
    results = run(world, 8, "wrapping:layout", {"model": "mlp"})
    eager = results[0]["eager"]
    assert any(v.shape[0] < 8 for v in eager.values())
    empty = [(r, q["name"]) for r, got in enumerate(results) for q in got["params"] if q["local_shape"][0] == 0]
    assert empty and all(r == 7 for r, _ in empty)
    for r, got in enumerate(results):
        for q in got["params"]:
            start, end = row_range(eager[q["name"]].shape[0], 8, r)
            assert (
                q["local_shape"] == (end - start, *eager[q["name"]].shape[1:]) and q["shape"] == eager[q["name"]].shape
            )
    assert sum(got["numel_local"] for got in results) == sum(v.size for v in eager.values())


def test_root_after_children_holds_no_duplicate(world):
    n = 2
    results = run(world, n, "wrapping:layout", {"model": "tinylm"})
    eager = results[0]["eager"]
    seen: list[str] = []
    for unit in results[0]["units"]:
        seen += [f"{unit['prefix']}.{q['fqn']}" if unit["prefix"] else q["fqn"] for q in unit["params"]]
    assert sorted(seen) == sorted(eager)  # every parameter in exactly one unit
    assert len(seen) == len(set(seen))
    root = [u for u in results[0]["units"] if u["prefix"] == ""]
    assert root and all(not q["fqn"].startswith(("blocks.", "embed.")) for q in root[0]["params"])
    # what the optimizer sees: the original parameters, each a DTensor holding this rank's rows
    for r in range(n):
        assert [q["name"] for q in results[r]["params"]] == list(eager)
        assert all(q["type"] == "DTensor" for q in results[r]["params"])
    assert sum(results[r]["numel_local"] for r in range(n)) == sum(v.size for v in eager.values())


def test_tied_weight_is_stored_once(world):
    results = run(world, 2, "wrapping:layout", {"model": "tinylm_tied"})
    params = [(u["prefix"], q) for u in results[0]["units"] for q in u["params"]]
    tied = [q for prefix, q in params if prefix == "" and q["fqn"] == "embed.weight"]
    assert len(tied) == 1 and tied[0]["owners"] == ["embed.weight", "head.weight"]
    assert not any(q["fqn"] == "head.weight" for _, q in params)
    assert sorted(results[0]["eager"]) == sorted(f"{p}.{q['fqn']}" if p else q["fqn"] for p, q in params)
    assert results[0]["tied_same_object"] is True  # model.embed.weight is model.head.weight
    # state_dict() gives the DTensors without communication, the tie under both names
    sd = results[0]["state_dict"]
    assert sd["head.weight"] == sd["embed.weight"] == ("DTensor", results[0]["eager"]["embed.weight"].shape)
    assert all(kind == "DTensor" for kind, _ in sd.values())


# ----------------------------------------------------------------------- numerics vs plain


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_world_size_one_is_bitwise_equal_to_plain(world, plain, optimizer):
    payload = {**MLP, "optimizer": optimizer, "steps": 10}
    ref = plain(payload)
    got = run(world, 1, "training:train", payload)[0]
    assert got["losses"] == ref["losses"]
    assert_bitwise(got["params"], ref["params"])
    assert got["padding_max"] == 0.0
    assert max_diff(ref["params"], ref["initial"]) > 1e-3  # training moved the weights


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_replicated_data_matches_world_size_one(world, plain, n, optimizer):
    payload = {**MLP, "optimizer": optimizer, "steps": 10}
    ref = plain(payload)
    one = run(world, 1, "training:train", payload)[0]
    results = run(world, n, "training:train", payload)
    for r, got in enumerate(results):
        assert max_diff(got["params"], one["params"]) < REPLICATED_BOUND, f"rank {r} vs W=1"
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND, f"rank {r} vs plain"
        assert np.max(np.abs(np.subtract(got["losses"], ref["losses"]))) < 1e-6
        assert got["padding_max"] == 0.0  # after every reduce-scatter and optimizer step


def test_replicated_data_at_world_size_eight(world, plain):
    payload = {**MLP, "optimizer": "adamw", "steps": 5}
    ref = plain(payload)
    results = run(world, 8, "training:train", payload)
    assert max(max_diff(got["params"], ref["params"]) for got in results) < REPLICATED_BOUND
    assert all(got["padding_max"] == 0.0 for got in results)


@pytest.mark.parametrize("n", [2, 4])
def test_split_data_matches_the_full_batch(world, plain, n):
    payload = {**MLP, "optimizer": "sgd", "steps": 5}
    ref = plain(payload)
    results = run(world, n, "training:train", {**payload, "data_mode": "split"})
    for got in results:
        assert max_diff(got["params"], ref["params"]) < SPLIT_BOUND
    # the mean of the ranks' local losses is the full-batch loss of the same step
    mean_loss = np.mean([got["losses"] for got in results], axis=0)
    assert np.max(np.abs(mean_loss - ref["losses"])) < 1e-6
    assert ref["losses"][-1] < ref["losses"][0]


def test_summing_instead_of_averaging_is_caught(world, plain):
    """The check above can fail: the classic ZeRO bug (reduce with SUM, no division by W) gives
    W x the gradient, which replicated data at W=2 shows at once against W=1."""
    payload = {**MLP, "optimizer": "sgd", "steps": 3}
    ref = plain(payload)
    good = run(world, 2, "training:train", payload)
    buggy = run(world, 2, "training:train", {**payload, "sum_bug": True})
    assert max_diff(good[0]["params"], ref["params"]) < REPLICATED_BOUND
    assert max_diff(buggy[0]["params"], ref["params"]) > 1e3 * REPLICATED_BOUND


@pytest.mark.parametrize("n", [1, 2])
def test_tied_embedding_and_head_train_like_plain(world, plain, n):
    payload = {"model": "tinylm_tied", "batch": 4, "optimizer": "adamw", "lr": 0.01, "steps": 3}
    ref = plain(payload)
    assert "embed.weight" in ref["params"] and "head.weight" not in ref["params"]  # tied: listed once
    for got in run(world, n, "training:train", payload):
        if n == 1:
            assert_bitwise(got["params"], ref["params"])
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND
        assert max_diff(got["params"], got["initial"]) > 1e-4


def test_untied_transformer_trains_like_plain(world, plain):
    payload = {"model": "tinylm", "batch": 4, "optimizer": "adamw", "lr": 0.01, "steps": 3}
    ref = plain(payload)
    for got in run(world, 2, "training:train", payload):
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


@pytest.mark.parametrize("case", ["siblings", "child_then_root"])
def test_sharing_a_parameter_across_units_raises_a_clear_error(world, case):
    messages = run(world, 2, "wrapping:shared_across_units", case)
    for msg in messages:
        assert "shared with a module already passed to fully_shard" in msg
        assert "tied parameters must live in one unit" in msg
        assert "weight" in msg


def test_frozen_parameters_stay_unchanged_and_get_no_grad(world, plain):
    payload = {**MLP, "optimizer": "sgd", "steps": 3, "frozen": ["layers.1.weight"]}
    ref = plain(payload)
    for got in run(world, 2, "training:train", payload):
        assert np.array_equal(got["params"]["layers.1.weight"], got["initial"]["layers.1.weight"])
        for name in ("layers.0.weight", "layers.1.bias", "layers.2.weight"):
            assert not np.array_equal(got["params"][name], got["initial"][name]), name
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND
        flags = got["grads_after_backward"]
        assert (False, False) in flags  # the frozen group's shard: no gradient
        assert all(has_grad == requires for requires, has_grad in flags)


def test_buffers_are_broadcast_from_rank_zero(world):
    results = run(world, 3, "wrapping:buffers")
    for r, bufs in enumerate(results):
        # rank 0 built stat = 0.5 everywhere and inner = [0, 1, 2, 3] x (0 + 1)
        assert np.array_equal(bufs["stat"], np.full(5, 0.5, dtype=np.float32)), f"rank {r}"
        assert np.array_equal(bufs["lin.inner"], np.arange(4, dtype=np.float32)), f"rank {r}"


@pytest.mark.parametrize("n", [1, 2])
def test_a_dropped_model_leaves_nothing_alive(world, n):
    for r, left in enumerate(run(world, n, "wrapping:released", {"model": "tinylm"})):
        assert left == [], f"rank {r} still holds the parameters {left}"


# ------------------------------------------------------------------ state dicts and meta init


@pytest.mark.parametrize("n", [1, 3])
def test_full_state_dict_round_trip(world, n):
    results = run(world, n, "state_dicts_and_meta_init:state_dict_round_trip", {"model": "tinylm_tied", "batch": 4})
    for r, got in enumerate(results):
        assert sorted(got["saved"]) == sorted(got["plain_names"])  # unwrapped names, tie once
        assert got["unexpected"] == [] and set(got["missing"]) <= {"head.weight"}
        assert max_diff(got["before"], got["saved"]) > 1e-3  # the fresh model really differed
        assert_bitwise(got["loaded"], got["saved"])
        assert np.array_equal(got["out_fresh"], got["out_plain"]), f"rank {r}"
        assert got["padding_max"] == 0.0
    for got in results[1:]:
        assert_bitwise(got["saved"], results[0]["saved"])  # every rank gathers the same values


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("model", ["mlp", "tinylm_tied", "tinylm"])
def test_meta_init_is_bitwise_identical_to_eager(world, n, model):
    for r, got in enumerate(run(world, n, "state_dicts_and_meta_init:meta_init", {"model": model, "seed": 7})):
        assert_bitwise(got["meta"], got["eager"])
        assert np.array_equal(got["meta_out"], got["eager_out"]), f"rank {r}"
        assert got["devices"] == ["cpu"] and got["padding_max"] == 0.0


# --------------------------------------------------------------------------- mixed precision


def test_bf16_params_train_with_fp32_master_shards(world, plain):
    payload = {**MLP, "optimizer": "adamw", "lr": 0.02, "steps": 5}
    fp32_ref = plain(payload)
    for got in run(world, 2, "training:mixed_precision", {**payload, "mp": {"param_dtype": "bfloat16"}}):
        assert got["out_dtypes"] == ["torch.bfloat16"]  # the compute really ran in bf16
        assert got["shard_dtypes"] == ["torch.float32"]  # master shards
        assert got["grad_dtypes"] == ["torch.float32"] and got["opt_state_dtypes"] == ["torch.float32"]
        # bf16 gradients, averaged one step wider than bf16 by default
        assert got["reduce_calls"] == [("torch.bfloat16", "torch.float32")]
        assert all(math.isfinite(v) for v in got["losses"]) and got["losses"][-1] < got["losses"][0]
        diff = max_diff(got["params"], fp32_ref["params"])
        assert 0.0 < diff < 0.05  # bf16 rounding changed the trajectory, but only a little
        assert got["padding_max"] == 0.0


@pytest.mark.parametrize(
    "mp, expected",
    [
        ({}, ("torch.float32", "torch.float64")),
        ({"reduce_dtype": "float32"}, ("torch.float32", "torch.float32")),
        ({"param_dtype": "bfloat16", "reduce_dtype": "float64"}, ("torch.bfloat16", "torch.float64")),
    ],
)
def test_reduce_dtype_is_honoured(world, mp, expected):
    for got in run(world, 2, "training:mixed_precision", {**MLP, "steps": 1, "mp": mp}):
        assert got["reduce_calls"] == [expected]
        assert got["grad_dtypes"] == ["torch.float32"]


def test_fp32_reduce_still_matches_plain_with_replicated_data(world, plain):
    payload = {**MLP, "optimizer": "adamw", "lr": 0.02, "steps": 5}
    ref = plain(payload)
    for got in run(world, 2, "training:mixed_precision", {**payload, "mp": {"reduce_dtype": "float32"}}):
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


# ------------------------------------------------------------------------ training modes


def test_reshard_after_forward_controls_what_stays_gathered(world):
    p = {"model": "tinylm", "batch": 4}
    on = run(world, 2, "training:handle_states_after_forward", {**p, "reshard": True})[0]
    off = run(world, 2, "training:handle_states_after_forward", {**p, "reshard": False})[0]
    assert set(on["after_forward"]) == {"<root>", "embed", "blocks.0", "blocks.1"}
    for unit, handles in on["after_forward"].items():
        assert handles == [("SHARDED", 0)] * len(handles), unit
    for unit, handles in off["after_forward"].items():  # (before state_dict() resharded them)
        assert all(state == "UNSHARDED" and nbytes > 0 for state, nbytes in handles), unit
    for got in (on, off):
        for unit, handles in got["after_backward"].items():
            assert handles == [("SHARDED", 0)] * len(handles), unit
        # state_dict() mid-step still gives the sharded DTensors; the backward after it gathers again
        assert got["state_dict_types"] == ["DTensor"] and got["grads"] == ["DTensor"]


def test_reshard_after_forward_to_a_smaller_group_keeps_its_block_and_regathers_within_it(world):
    """reshard_after_forward=2 at 4 ranks: after forward every unit's modules are back on their shards with no
    unsharded storage, and each rank keeps 2 of the 4 ranks' padded chunks (its pair's half); backward
    all-gathers over groups of 2 ranks only, and nothing is kept after it."""
    p = {"model": "tinylm", "batch": 4, "reshard": 2}
    for got in run(world, 4, "training:resharded_to_a_group", p):
        assert set(got["after_forward"]) == {"<root>", "embed", "blocks.0", "blocks.1"}
        for unit, held in got["after_forward"].items():
            assert held["handles"] == [("SHARDED", 0)] * len(held["handles"]), unit
            assert held["kept"] == 2 * held["shard"] > 0, unit
        assert set(got["backward_gathers"]) == {2}, got["backward_gathers"]
        assert got["kept_after_backward"] == []


def test_reshard_after_forward_to_a_smaller_group_trains_bitwise_like_a_full_reshard(world):
    payload = {"model": "tinylm", "batch": 4, "optimizer": "adamw", "lr": 0.01, "steps": 3}
    full = run(world, 4, "training:train", {**payload, "reshard": True})
    for a, b in zip(full, run(world, 4, "training:train", {**payload, "reshard": 2})):
        assert a["losses"] == b["losses"] and max_diff(a["params"], b["params"]) == 0.0


def test_reshard_after_forward_must_divide_the_group(world):
    got = run(world, 4, "training:refused", {"model": "mlp", "batch": 4, "reshard": 3})
    assert all("divisor of the shard group's 4 ranks" in g for g in got), got


def test_a_parameter_sharded_on_dim_1_holds_its_columns_and_trains_bitwise_like_dim_0(world):
    """shard_placement_fn (Shard(1) where dim 1 divides: tinylm's 32-wide matrices at 4 ranks, its 86-wide one
    stays Shard(0), in the same units): each rank holds 8 of 32 columns, and 3 AdamW steps give bitwise the
    losses and full parameters of dim-0 sharding, with a post-forward group of 2 too."""
    got = run(world, 4, "training:placements", {"model": "tinylm", "batch": 4, "dim1": True})[1]
    assert got["blocks.0.attn.wq.weight"] == ("Shard(1)", [32, 8]) and got["embed.weight"] == ("Shard(1)", [61, 8])
    assert got["blocks.0.mlp.w2.weight"] == ("Shard(0)", [8, 86]) and got["norm.weight"][0] == "Shard(0)"
    payload = {"model": "tinylm", "batch": 4, "optimizer": "adamw", "lr": 0.01, "steps": 3}
    rows = run(world, 4, "training:train", payload)
    for reshard in (True, 2):
        for a, b in zip(rows, run(world, 4, "training:train", {**payload, "dim1": True, "reshard": reshard})):
            assert a["losses"] == b["losses"] and max_diff(a["params"], b["params"]) == 0.0


def test_reshard_after_forward_false_trains_like_plain(world, plain):
    payload = {"model": "tinylm", "batch": 4, "optimizer": "adamw", "lr": 0.01, "steps": 3}
    ref = plain(payload)
    for got in run(world, 2, "training:train", {**payload, "reshard": False}):
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


@pytest.mark.parametrize("reshard", [True, False])
def test_a_unit_called_twice_in_one_forward(world, reshard):
    ref = run(world, 1, "training:unit_called_twice", {"wrap": False, "reshard": reshard})[0]
    for got in run(world, 2, "training:unit_called_twice", {"wrap": True, "reshard": reshard}):
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


@pytest.mark.parametrize("n", [1, 2])
def test_a_checkpoint_around_the_unit_call_recomputes_without_reducing_twice(world, n):
    """The recomputation runs the unit's hooks again inside backward: they gather (already done)
    and register nothing, so each unit reduces once per step (2 units x 3 steps)."""
    ref = run(world, 1, "training:checkpoint_around_unit", {"wrap": False})[0]
    for got in run(world, n, "training:checkpoint_around_unit", {"wrap": True}):
        assert got["reductions"] == 6
        if n == 1:
            assert_bitwise(got["params"], ref["params"])
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


def test_gradient_accumulation_over_two_backwards(world):
    got = run(world, 2, "training:grad_accumulation", {"model": "mlp", "batch": 8})[0]
    whole = got["plain_whole"]
    scale = max(float(np.max(np.abs(g))) for g in whole.values())
    # two half-batch backwards = one full-batch backward, up to fp32 rounding of the sums
    assert max_diff(got["fsdp_accumulated"], whole) <= 1e-6 * max(scale, 1.0)
    # and the same operations as the plain model's accumulation / single backward
    assert max_diff(got["fsdp_accumulated"], got["plain_accumulated"]) < REPLICATED_BOUND
    assert max_diff(got["fsdp_whole"], whole) < REPLICATED_BOUND
    assert scale > 0
    # the reduction switched off for the first half: nothing reduced then, the same sum at the end
    assert got["no_sync_reduced_early"] is False
    assert max_diff(got["fsdp_no_sync"], got["plain_accumulated"]) < REPLICATED_BOUND


def test_eval_under_no_grad_between_steps(world):
    ref = run(world, 1, "training:eval_no_grad", {"model": "mlp", "wrap": False})[0]
    for got in run(world, 2, "training:eval_no_grad", {"model": "mlp"}):
        assert len(got["evals"]) == len(ref["evals"]) == 3
        for a, b in zip(got["evals"], ref["evals"]):
            assert np.max(np.abs(a - b)) < REPLICATED_BOUND
        assert got["full_bytes_after_eval"] == 0  # no gathered copy outlives a no_grad forward
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


@pytest.mark.parametrize("n", [2, 3])
def test_garbage_in_the_padding_rows_never_reaches_a_parameter(world, plain, n):
    ref = plain({**MLP, "optimizer": "sgd", "steps": 3})
    results = run(world, n, "training:padding_garbage", {**MLP})
    assert sum(got["corrupted"] for got in results) > 0  # there was padding to corrupt
    for got in results:
        assert got["looked"] > 0 and not got["seen"]  # no gathered parameter, no gradient held it
        assert max_diff(got["params"], ref["params"]) < REPLICATED_BOUND


@pytest.mark.parametrize("via", ["fsdp_impl", "torch"])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_clips_by_the_global_norm(world, n, norm_type, via):
    """The norm over every rank's shard (not a rank's own), the same coefficient on every rank: the
    gradients match torch's clipping of the plain model; bitwise at one rank, and for the infinity
    norm (a maximum) at any world size. fsdp_impl.clip_grad_norm_ (one all-reduce) and torch's own
    clip_grad_norm_ on the DTensor gradients alike."""
    got = run(
        world, n, "training:clipped", {"model": "tinylm_tied", "max_norm": 0.05, "norm_type": norm_type, "via": via}
    )
    norms = {g["fsdp"][0] for g in got}
    assert len(norms) == 1, norms  # every rank reports the same global norm
    (norm, grads), (plain_norm, plain_grads) = got[0]["fsdp"], got[0]["plain"]
    assert plain_norm > 0.05  # clipping acted
    if n == 1 or norm_type == math.inf:
        assert norm == plain_norm
        assert max_diff(grads, plain_grads) == 0.0
    else:
        assert abs(norm - plain_norm) <= 1e-6 * plain_norm
        assert max_diff(grads, plain_grads) < REPLICATED_BOUND
