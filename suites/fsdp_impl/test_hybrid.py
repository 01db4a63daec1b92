"""fsdp_impl's hybrid sharding (HSDP: R replicas x S shards) in real process worlds (gloo, CPU).

Rank-side steps live in ``suites/fsdp_impl/worlds/hybrid.py``; one ``World`` per world size is
started once for this module and reused. Meshes are named R x S. The reference is the PLAIN model
(no fsdp_impl code) trained at world size 1; fsdp_impl at world size 1 is bitwise that model
(test_fsdp_impl.py), so "bitwise the plain model" is "bitwise fsdp_impl at W = 1".

Why replicated data is bitwise and split data is not: every rank's gradient is summed in fp64
(exact for R x S fp32 addends of similar size) and divided once, so W identical gradients give
back exactly the one gradient. With split data each rank runs forward/backward on B/W samples:
its loss is a mean over fewer samples and the weight-gradient matmuls sum over fewer rows, in
another order than one rank summing all B, so the gradients differ from the full-batch ones by
fp32 rounding (about 1e-7 relative) before any reduction. The reduction adds nothing of its own:
split-data HSDP is bitwise the flat (non-hybrid) fsdp_impl at the same W.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from suites.fsdp_impl.worlds.common import plain_runs

TASKS = "suites.fsdp_impl.worlds.hybrid"
SPLIT_BOUND = 1e-6  # split data vs the full batch at W = 1, 3 SGD steps (fp32 rounding of local sums)

# (replicas, shards): world size R x S; ids read "RxS"
MESHES = [(2, 1), (2, 2), (4, 1), (2, 4), (4, 2)]
MESH_IDS = [f"{r}x{s}" for r, s in MESHES]


# ----------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plain(world):
    """plain(payload) -> the PLAIN model trained at world size 1 (cached per payload)."""
    return plain_runs(world, f"{TASKS}:train")


def run(world, replicas: int, shards: int, task: str, payload=None) -> list:
    return world(replicas * shards).call(f"{TASKS}:{task}", payload)


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a)


def assert_bitwise(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert np.array_equal(a[k], b[k]), f"{what}: {k}: max diff {np.max(np.abs(a[k] - b[k]))}"


def assert_replicas_agree(results: list[dict], shards: int) -> None:
    """Rank r * S + i holds bitwise the shard of rank i (replica 0) after every step."""
    for rank, got in enumerate(results):
        twin = results[rank % shards]
        for step, (mine, theirs) in enumerate(zip(got["shards"], twin["shards"])):
            assert np.array_equal(mine, theirs), f"rank {rank} vs rank {rank % shards}, step {step + 1}"


def payload(model: str, **kw) -> dict:
    return {"model": model, "batch": 8, "optimizer": "adamw", "lr": 0.01, "steps": 3, **kw}


# ----------------------------------------------------------------------------- training


# the mlp on every mesh (2x4, 8 ranks, with --ci); the tied model (its tie in the root unit) on the 2x2 mesh, its
# other meshes repeating the mlp's with --slow
@pytest.mark.parametrize(
    "model, replicas, shards",
    [
        pytest.param(
            model,
            r,
            s,
            id=f"{i}-{model}",
            marks=pytest.mark.slow if model != "mlp" and i != "2x2" else pytest.mark.ci if i == "2x4" else (),
        )
        for (r, s), i in zip(MESHES, MESH_IDS)
        for model in ("mlp", "tinylm_tied")
    ],
)
def test_replicated_data_is_bitwise_world_size_one(world, plain, model, replicas, shards):
    ref = plain(payload(model))
    results = run(world, replicas, shards, "train", {**payload(model), "replicas": replicas})
    for rank, got in enumerate(results):
        assert got["losses"] == ref["losses"], f"rank {rank}"
        for step, (mine, theirs) in enumerate(zip(got["params"], ref["params"])):
            assert_bitwise(mine, theirs, f"rank {rank} step {step + 1}")
        # one hybrid reduction per unit per step, no flat one
        assert got["calls"] == [{"flat": 0, "hybrid": got["reducing_units"]}] * 3, f"rank {rank}"
        # each rank holds its 1/S of every parameter's rows (by its position in its shard group)
        i = rank % shards
        assert all(
            held == max(0, min(math.ceil(rows / shards), rows - i * math.ceil(rows / shards)))
            for rows, _, held in got["layouts"]
        ), got["layouts"]
        assert got["numel_local"] == sum(row * held for _, row, held in got["layouts"])
    # the S ranks of a replica hold every parameter element once
    params = ref["params"][0]
    assert sum(results[i]["numel_local"] for i in range(shards)) == sum(v.size for v in params.values())
    assert_replicas_agree(results, shards)
    assert max_diff(ref["params"][-1], ref["params"][0]) > 1e-4  # training moved the weights


@pytest.mark.parametrize(
    "replicas, shards",
    [  # 2x4 repeats 2x2 and 4x2 at 8 ranks: the CI tier's (--ci)
        (2, 2),
        pytest.param(2, 4, marks=pytest.mark.ci),
        (4, 2),
    ],
    ids=["2x2", "2x4", "4x2"],
)
def test_split_data_is_the_full_batch_mean(world, plain, replicas, shards):
    """SGD (the update is linear in the gradient, so a wrong scale shows): within SPLIT_BOUND of the
    full batch at W = 1 at every step, and bitwise the flat fsdp_impl at the same world size."""
    p = {**payload("mlp"), "optimizer": "sgd", "lr": 0.05, "data_mode": "split"}
    ref = plain({k: v for k, v in p.items() if k != "data_mode"})
    hybrid = run(world, replicas, shards, "train", {**p, "replicas": replicas})
    flat = run(world, replicas, shards, "train", {**p, "replicas": 1})
    for rank, (got, one) in enumerate(zip(hybrid, flat)):
        for step in range(3):
            assert max_diff(got["params"][step], ref["params"][step]) < SPLIT_BOUND, f"rank {rank} step {step + 1}"
            assert_bitwise(got["params"][step], one["params"][step], f"rank {rank} step {step + 1} vs flat")
    assert_replicas_agree(hybrid, shards)
    mean_loss = np.mean([got["losses"] for got in hybrid], axis=0)
    assert np.max(np.abs(mean_loss - ref["losses"])) < 1e-6


def test_split_data_adamw_is_bitwise_the_flat_sharding(world, plain):
    """AdamW divides by sqrt(v): elements with tiny gradients turn the fp32 rounding of the local
    sums into larger parameter differences than SGD (measured 1.2e-6 vs W = 1 here, 3.3e-6 for mlp
    at 2x4 with one sample per rank); the same as flat sharding, bit for bit."""
    p = {**payload("tinylm_tied"), "data_mode": "split"}
    hybrid = run(world, 2, 2, "train", {**p, "replicas": 2})
    flat = run(world, 2, 2, "train", {**p, "replicas": 1})
    for rank, (got, one) in enumerate(zip(hybrid, flat)):
        for step in range(3):
            assert_bitwise(got["params"][step], one["params"][step], f"rank {rank} step {step + 1}")
    ref = plain(payload("tinylm_tied"))
    assert max_diff(hybrid[0]["params"][-1], ref["params"][-1]) < 1e-5


@pytest.mark.parametrize("replicas, shards", [(2, 2), (2, 4), (4, 2)], ids=["2x2", "2x4", "4x2"])
def test_reduction_is_the_mean_over_all_ranks(world, replicas, shards):
    """hybrid_reduce_mean itself: identical gradients come back exactly; different ones give the
    fp64 sum over all R x S ranks divided once and rounded to fp32 (this rank's shard of it)."""
    numel = shards * 13  # 13 per shard: not a multiple of R, so the replica exchange pads
    results = run(world, replicas, shards, "reduction", {"replicas": replicas, "numel": numel, "scale": 3.0})
    every = np.stack([got["own"].astype(np.float64) for got in results])
    expected = (every.sum(axis=0) / len(results)).astype(np.float32)
    for rank, got in enumerate(results):
        assert got["shard_size"] == shards and got["shard_rank"] == rank % shards
        assert got["shard_ranks"] == [rank // shards * shards + i for i in range(shards)]
        assert got["replicate_ranks"] == [r * shards + rank % shards for r in range(replicas)]
        lo, hi = got["shard_rank"] * 13, (got["shard_rank"] + 1) * 13
        assert np.array_equal(got["mean_same"], got["same"][lo:hi]), f"rank {rank}"
        assert np.array_equal(got["mean_own"], expected[lo:hi]), f"rank {rank}"


@pytest.mark.parametrize("model", ["mlp", "tinylm_tied"])
def test_accumulation_with_sync_off_reduces_once(world, plain, model):
    """Two micro-batches per step, sync off for the first: no reduction (no gradient at all) until
    the last micro-batch, then one per unit; bitwise the plain model accumulating the same way."""
    p = {**payload(model), "micro": 2}
    ref = plain(p)
    for rank, got in enumerate(run(world, 2, 2, "train", {**p, "replicas": 2})):
        assert got["grad_before_last"] is False, f"rank {rank}: a gradient was reduced with sync off"
        assert got["calls"] == [{"flat": 0, "hybrid": got["reducing_units"]}] * 3
        for step, (mine, theirs) in enumerate(zip(got["params"], ref["params"])):
            assert_bitwise(mine, theirs, f"rank {rank} step {step + 1}")


# ------------------------------------------------------------------------ clipping, buffers, init


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("replicas, shards", [(2, 1), (2, 2), (2, 4)], ids=["2x1", "2x2", "2x4"])
def test_clip_grad_norm_is_the_global_norm(world, replicas, shards, norm_type):
    """Reduced over the shard group only: counting every replica would give sqrt(R) x the norm."""
    p = {"model": "tinylm_tied", "batch": 8, "max_norm": 0.05, "norm_type": norm_type}
    ref = world(1).call(f"{TASKS}:clipped", {**p, "wrap": False})[0]
    results = run(world, replicas, shards, "clipped", {**p, "replicas": replicas})
    assert len({got["norm"] for got in results}) == 1  # every rank, every replica: one norm
    norm = results[0]["norm"]
    assert ref["norm"] > 0.05  # clipping acted
    if norm_type == math.inf or shards == 1:  # a maximum, or torch's own computation on whole shards
        assert norm == ref["norm"]
        for got in results:
            assert_bitwise(got["grads"], ref["grads"], "clipped gradients")
    else:
        assert abs(norm - ref["norm"]) <= 1e-6 * ref["norm"]
        scale = max(float(np.max(np.abs(g))) for g in ref["grads"].values())
        assert max(max_diff(got["grads"], ref["grads"]) for got in results) <= 1e-6 * scale


def test_buffers_are_rank_zeros_on_every_replica(world):
    for rank, bufs in enumerate(run(world, 2, 2, "buffers", {"replicas": 2})):
        # rank 0 built stat = 0.5 everywhere and inner = [0, 1, 2, 3] x (0 + 1)
        assert np.array_equal(bufs["stat"], np.full(5, 0.5, dtype=np.float32)), f"rank {rank}"
        assert np.array_equal(bufs["lin.inner"], np.arange(4, dtype=np.float32)), f"rank {rank}"


def test_meta_init_is_bitwise_eager(world):
    results = run(world, 2, 2, "meta_init", {"model": "tinylm_tied", "seed": 7, "replicas": 2})
    for rank, got in enumerate(results):
        assert_bitwise(got["meta"], got["eager"], f"rank {rank}")
        assert np.array_equal(got["shards"], results[rank % 2]["shards"])


# ------------------------------------------------------------------------------- groups


def test_group_size_not_divisible_by_replicas_is_refused(world):
    for msg in run(world, 2, 2, "bad_replicas", 3):
        assert "4 ranks cannot be split into replicas=3" in msg and "positive divisor of 4" in msg


@pytest.mark.parametrize(
    "case, says", [("same_group", "share only this rank"), ("crossed", "must hold the same shard")]
)
def test_groups_not_in_the_hybrid_layout_are_refused(world, case, says):
    """Every rank raises (none is left waiting in a collective)."""
    for rank, msg in enumerate(run(world, 2, 2, "bad_layout", case)):
        assert "do not form the hybrid layout" in msg and says in msg, f"rank {rank}: {msg!r}"


def test_hybrid_groups_over_a_subgroup_maps_global_ranks(world):
    """Over evens {0, 2} and odds {1, 3} of W = 4 with 2 replicas: shard groups of one rank, the
    replicate group is the parent subgroup in global ranks; the mean is over its two ranks."""
    for rank, got in enumerate(run(world, 2, 2, "subgroup", {"replicas": 2})):
        assert got["shard_ranks"] == [rank]
        assert got["replicate_ranks"] == [rank % 2, rank % 2 + 2]
        assert np.array_equal(got["mean"], np.full(5, (rank % 2 + rank % 2 + 2) / 2, dtype=np.float32))
