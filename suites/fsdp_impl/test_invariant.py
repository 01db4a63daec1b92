"""fsdp_impl's batch-invariant mode (fsdp_impl.invariant) in real process worlds (gloo, CPU): with split data,
every world size trains the same bits as every other and as the plain model summing the same L
micro-batches in the same tree; the default mode does not (its split runs differ by rounding).

Rank-side steps live in ``suites/fsdp_impl/worlds/invariant.py``."""

from __future__ import annotations

import numpy as np
import pytest

TASKS = "suites.fsdp_impl.worlds.invariant"
SIZES = (1, 2, 4, 8)


def _same(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} != {b['losses']}"
    for k in a["params"]:
        assert np.array_equal(a["params"][k], b["params"][k]), (
            f"{what}: {k} max diff {np.max(np.abs(a['params'][k] - b['params'][k]))}"
        )


@pytest.fixture(scope="module")
def reference(world):
    cache = {}

    def get(**p):
        key = tuple(sorted(p.items()))
        if key not in cache:
            cache[key] = world(1).call(f"{TASKS}:train", {**p, "wrap": False})[0]
        return cache[key]

    return get


@pytest.mark.parametrize(
    "optimizer, model",
    [  # the other two pairs: the CI tier's (--ci)
        ("sgd", "mlp"),
        pytest.param("sgd", "tinylm_tied", marks=pytest.mark.ci),
        pytest.param("adamw", "mlp", marks=pytest.mark.ci),
        ("adamw", "tinylm_tied"),
    ],
    ids=["sgd-mlp", "sgd-tinylm_tied", "adamw-mlp", "adamw-tinylm_tied"],
)
def test_every_world_size_is_bitwise_the_tree_reference(world, reference, model, optimizer):
    p = {"model": model, "optimizer": optimizer, "micro": 8}
    want = reference(**p)
    for w in SIZES:
        got = world(w).call(f"{TASKS}:train", p)
        for rank, r in enumerate(got):
            _same(r, want, f"W={w} rank {rank}")


def test_sixteen_micro_batches_of_one_sample_and_the_inf_clip_stay_invariant(world, reference):
    p = {"model": "tinylm", "micro": 16, "clip_inf": 0.01}
    want = reference(**p)
    for w in (2, 8):
        _same(world(w).call(f"{TASKS}:train", p)[0], want, f"W={w}")


@pytest.mark.parametrize("feature", ["bf16", "ac"])
def test_bf16_and_activation_checkpointing_stay_invariant(world, reference, feature):
    """bf16: each micro-batch's bf16 gradient cast to the policy's fp32 reduce dtype, the tree in fp32; ac: the
    recomputation computes what the forward computed."""
    p = {"model": "tinylm_tied", "micro": 8, feature: True}
    want = reference(**p)
    for w in (2, 4):
        _same(world(w).call(f"{TASKS}:train", p)[0], want, f"{feature} W={w}")


def test_the_invariant_l2_clip_keeps_every_world_size_bitwise(world, reference):
    """clip_grad_norm_(batch_invariant=True): float64 sums of squares per row, gathered, summed in row order; the
    reference clips the plain model by the same formula (fsdp_impl.clip.row_norm_sq on its whole gradients)."""
    p = {"model": "tinylm_tied", "micro": 8, "clip2": 0.01}
    want = reference(**p)
    for w in (2, 4, 8):
        for rank, r in enumerate(world(w).call(f"{TASKS}:train", p)):
            _same(r, want, f"W={w} rank {rank}")


@pytest.mark.parametrize(
    "saved,resumed",
    [  # the two with 8 ranks: the CI tier's (--ci)
        pytest.param(2, 8, marks=pytest.mark.ci),
        pytest.param(8, 1, marks=pytest.mark.ci),
        (4, 2),
    ],
)
def test_a_run_resumed_at_another_world_size_is_bitwise_the_uninterrupted_run(world, tmp_path, saved, resumed):
    """Parameters and optimizer state are element-wise, and a checkpoint moves them whole: 2 steps at one world
    size, saved, 2 more at another, is every step's loss and the final parameters of 4 uninterrupted steps."""
    p = {"model": "tinylm_tied", "micro": 8}
    whole = world(1).call(f"{TASKS}:train_part", {**p, "first": 1, "last": 4})[0]
    path = str(tmp_path / "ckpt")
    first = world(saved).call(f"{TASKS}:train_part", {**p, "first": 1, "last": 2, "save": path})[0]
    second = world(resumed).call(f"{TASKS}:train_part", {**p, "first": 3, "last": 4, "load": path})[0]
    _same(
        {"losses": first["losses"] + second["losses"], "params": second["params"]},
        whole,
        f"saved at {saved}, resumed at {resumed}",
    )


def test_replicated_data_is_the_tree_reference_at_every_world_size(world, reference):
    """Every rank holds the whole batch: its own whole tree, the W identical sums averaged exactly."""
    p = {"model": "tinylm_tied", "micro": 8, "data_mode": "replicated"}
    want = reference(**{k: v for k, v in p.items() if k != "data_mode"})
    for w in (2, 4):
        for rank, r in enumerate(world(w).call(f"{TASKS}:train", p)):
            _same(r, want, f"W={w} rank {rank}")


def test_the_default_mode_is_not_invariant_with_split_data(world):
    """What the mode buys: fsdp_impl's default step on the same slices differs between world sizes."""
    p = {"model": "tinylm_tied", "micro": 8, "invariant": False}
    one, four = world(1).call(f"{TASKS}:train", p)[0], world(4).call(f"{TASKS}:train", p)[0]
    assert one["losses"] != four["losses"] or any(
        not np.array_equal(one["params"][k], four["params"][k]) for k in one["params"]
    )


def test_micro_batches_that_do_not_make_a_tree_are_refused(world):
    with pytest.raises(Exception, match="power of two"):
        world(2).call(f"{TASKS}:train", {"model": "mlp", "micro": 6})
