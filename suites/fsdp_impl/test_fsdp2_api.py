"""fsdp_impl as a drop-in for FSDP2's public API, in real process worlds (gloo, CPU).

Rank-side steps live in ``suites/fsdp_impl/worlds/fsdp2_api.py``. The claim: code written for FSDP2
(``fully_shard(block, mesh=mesh)``, the sharded module's methods, ``torch.nn.utils.clip_grad_norm_(
model.parameters(), ...)``, FSDP2's policy objects) runs with fsdp_impl's ``fully_shard`` swapped in and
computes BIT FOR BIT what fsdp_impl computes when called its own way (process groups, ``hybrid_groups``,
the package functions): the FSDP2 forms are another spelling, not another computation.

The one place where the two spellings compute differently is the norm-2 clip at W > 1: torch's
clip_grad_norm_ reduces DTensor partial norms in fp32, fsdp_impl.clip_grad_norm_ sums squares in fp64 in
one all-reduce. Both are the global norm (within float32 rounding of each other); the bitwise comparisons
there use torch's clip on both sides, and a separate one bounds the gap.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

TASKS = "suites.fsdp_impl.worlds.fsdp2_api"


def run(world, n: int, task: str, payload: dict) -> list:
    return world(n).call(f"{TASKS}:{task}", payload)


def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert np.array_equal(a[k], b[k]), f"{what}: {k}: max diff {np.max(np.abs(a[k] - b[k]))}"


def assert_same_run(got: list, ref: list) -> None:
    """Every rank: the same losses, norms and full parameters after every step, bit for bit."""
    for rank, (mine, theirs) in enumerate(zip(got, ref)):
        assert mine["losses"] == theirs["losses"], f"rank {rank}"
        assert mine["norms"] == theirs["norms"], f"rank {rank}"
        for step, (a, b) in enumerate(zip(mine["params"], theirs["params"])):
            assert_bitwise(a, b, f"rank {rank} step {step + 1}")
    assert any(np.max(np.abs(ref[0]["params"][-1][k] - ref[0]["params"][0][k])) > 0 for k in ref[0]["params"][0])


# ------------------------------------------------------------------- the harness's FSDP2 adapter


@pytest.mark.parametrize(
    "feature, n",
    [  # 4 ranks: the CI tier's (--ci), but reshard2, which needs them
        ("plain", 1),
        ("plain", 2),
        pytest.param("plain", 4, marks=pytest.mark.ci),
        ("hsdp", 2),
        pytest.param("hsdp", 4, marks=pytest.mark.ci),
        ("bf16", 2),
        ("reshard2", 4),
        ("shard1", 2),
        ("offload", 2),
    ],
)
def test_the_fsdp2_adapter_on_fsdp_impl_is_bitwise_the_fsdp_impl_adapter(world, feature, n):
    """harness/adapters/torch_fsdp2.py, code written for FSDP2 (a mesh made from the group, a 2-D
    (replicate, shard) mesh under hsdp, FSDP2's MixedPrecisionPolicy and OffloadPolicy objects, an int
    reshard_after_forward, a shard_placement_fn, ``wrapped.set_requires_gradient_sync``, torch's
    clip_grad_norm_ on ``wrapped.parameters()``) with fsdp_impl's fully_shard in place of FSDP2's, against
    the fsdp_impl adapter (process groups, the package functions, fsdp_impl.clip_grad_norm_): two
    micro-batches a step with sync off for the first, the inf-norm clip (exact on both sides), AdamW."""
    p = {"model": "tinylm", "feature": feature, "max_norm": 0.05, "norm_type": math.inf, "steps": 3}
    ref = run(world, n, "adapter_run", {**p, "impl": "fsdp_impl"})
    got = run(world, n, "adapter_run", {**p, "impl": "fsdp2_code"})
    assert_same_run(got, ref)
    assert all(g["is_unit"] and g["cls"] == "FSDPTransformerLM" for g in got + ref)
    assert max(ref[0]["norms"]) > 0.05  # the clip acted


# --------------------------------------------------------------- a loop written for FSDP2


@pytest.mark.parametrize(
    "mesh",
    [  # 4 ranks: the CI tier's (--ci)
        [1],
        [2],
        pytest.param([4], marks=pytest.mark.ci),
        [2, 1],
        pytest.param([2, 2], marks=pytest.mark.ci),
    ],
    ids=["1", "2", "4", "2x1", "2x2"],
)
def test_a_loop_written_for_fsdp2_is_bitwise_fsdp_impl_called_its_own_way(world, mesh):
    """fully_shard(block, mesh=init_device_mesh(...)) (2-D: ("replicate", "shard"), FSDP2's HSDP), the
    root at FSDP2's default reshard_after_forward, ``model.set_requires_gradient_sync`` for accumulation,
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)`` (norm 2): bitwise fsdp_impl with process
    groups (``hybrid_groups(R)`` for 2-D) and the package function, clipped by torch alike."""
    n = math.prod(mesh)
    p = {"model": "tinylm_tied", "mesh": mesh, "max_norm": 0.05, "norm_type": 2.0, "steps": 3}
    own = run(world, n, "loop", {**p, "way": "own"})
    got = run(world, n, "loop", {**p, "way": "fsdp2_code"})
    assert_same_run(got, own)
    assert got[0]["cls"] == "FSDPTransformerLM"
    # torch's norm is the global one: at step 1 (the same gradients on both sides) fsdp_impl.clip_grad_norm_'s
    # (one fp64 all-reduce over the shard group) within float32 rounding, bitwise at one rank
    theirs = run(world, n, "loop", {**p, "way": "own", "clip": "fsdp_impl"})
    for rank, (a, b) in enumerate(zip(got, theirs)):
        assert a["norms"][0] > 0.05  # the clip acted
        if n == 1:
            assert a["norms"] == b["norms"], f"rank {rank}"
            assert_bitwise(a["params"][-1], b["params"][-1], f"rank {rank}")
        else:
            assert abs(a["norms"][0] - b["norms"][0]) <= 1e-6 * b["norms"][0], f"rank {rank}"


def test_the_loop_is_fsdp2_code_fsdp2_runs_it_alike_at_one_rank(world):
    """The same loop on FSDP2 itself (its fully_shard, its DTensors): at one rank both are the plain
    model bit for bit, so FSDP2 and fsdp_impl give the same numbers from the same code."""
    p = {"model": "tinylm_tied", "mesh": [1], "max_norm": 0.05, "norm_type": 2.0, "steps": 3}
    got = run(world, 1, "loop", {**p, "way": "fsdp2_code"})
    fsdp2 = run(world, 1, "loop", {**p, "way": "fsdp2"})
    assert got[0]["cls"] == fsdp2[0]["cls"] == "FSDPTransformerLM"
    assert_same_run(got, fsdp2)


# ----------------------------------------------------------------------- the module methods


@pytest.fixture(scope="module")
def method_runs(world):
    cache: dict = {}

    def get(use: str, n: int = 2) -> list:
        if (use, n) not in cache:
            cache[(use, n)] = run(world, n, "methods", {"use": use})
        return cache[(use, n)]

    return get


def _gathers(result: dict) -> list:
    return [g for step in result["gathers"] for g in step]


@pytest.mark.parametrize("use", ["unshard", "reshard_after_backward", "reshard_after_forward", "prefetch"])
def test_a_method_changes_when_units_are_gathered_never_the_numbers(method_runs, use):
    plain, got = method_runs("none"), method_runs(use)
    for rank, (a, b) in enumerate(zip(got, plain)):
        for step, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert_bitwise(x, y, f"rank {rank} step {step + 1}")
    g, base, seen = _gathers(got[0]), _gathers(plain[0]), got[0]["seen"]
    first, second = got[0]["blocks"][:2]
    if use == "unshard":  # the first unit's gather issued before the forward; the second gathered, then given back
        assert seen["after_unshard"][first] == "GATHERING"
        assert seen["unsharded"][second] == "UNSHARDED" and seen["resharded"][second] == "SHARDED"
    elif use == "reshard_after_backward":  # micro-batch 0 leaves every unit gathered: its next forward gathers none
        assert set(seen["after_backward0"].values()) == {"UNSHARDED"}
        assert set(seen["after_backward1"].values()) == {"SHARDED"}
        assert len(g) * 4 == len(base) * 3
    elif use == "reshard_after_forward":  # no regather in backward
        assert set(seen["after_forward"].values()) == {"UNSHARDED"}
        assert len(g) * 2 == len(base)
    else:  # from the first forward on (no recorded order needed), block i + 1 is on its way as block i begins
        names = got[0]["blocks"]
        assert len(names) >= 2
        for i in range(len(names) - 1):
            assert seen[f"fwd{i}"][names[i + 1]] in ("GATHERING", "UNSHARDED"), seen
            assert plain[0]["seen"][f"fwd{i}"][names[i + 1]] == "SHARDED"
        assert sum(a for _, a in got[0]["gathers"][0]) > sum(a for _, a in plain[0]["gathers"][0])


def test_set_requires_gradient_sync_recurse_false_is_this_unit_only(world):
    got = run(world, 2, "sync_flags", {})
    for flags in got:
        assert flags == {"recurse": [False] * 4, "this_unit": [True, False, False, False]}


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("n", [1, 2])
def test_fsdp2_forms_fsdp_impl_cannot_honour_are_refused_clearly(world, n):
    got = run(world, n, "errors", {})
    expected = {
        "mesh_and_process_group": "ValueError: fully_shard: give either mesh=",
        "mesh_and_replicate_group": "ValueError: fully_shard: give either mesh=",
        "ignored_params": "ValueError: fully_shard: ignored_params is not supported",
        "dp_mesh_dims": "ValueError: fully_shard: dp_mesh_dims",
        "module_list": "ValueError: fully_shard: fsdp_impl shards one module per call",
        "output_dtype": "ValueError: fully_shard: MixedPrecisionPolicy.output_dtype is not supported",
        "cast_forward_inputs": "ValueError: fully_shard: MixedPrecisionPolicy(cast_forward_inputs=False)",
        "offload_policy": "ValueError: fully_shard: offload_policy must be a CPUOffloadPolicy",
        "mesh_3d": "ValueError: fully_shard: mesh must be 1-D (FSDP) or 2-D",
        "mesh_not_a_mesh": "ValueError: fully_shard: mesh must be a DeviceMesh",
        "reshard_after_forward_int": "ValueError: set_reshard_after_forward: a bool",
        "prefetch_not_a_unit": "ValueError: set_modules_to_forward_prefetch: every module must have been passed",
        "deepcopy": "TypeError: a module sharded by fsdp_impl cannot be deep-copied",
    }
    if n == 2:
        expected["mesh_out_of_order"] = "ValueError: fully_shard: this rank sits at position"
    for rank, errors in enumerate(got):
        assert sorted(errors) == sorted(expected)
        for case, start in expected.items():
            assert errors[case].startswith(start), f"rank {rank} {case}: {errors[case]!r}"
