"""DeepSpeed's ZeRO stages under the harness (harness/adapters/deepspeed.py), through DeepSpeed's own engine: every
stage trains each feature it takes (accumulation through gradient_accumulation_steps, clipping through
gradient_clipping, bf16 through its bf16 section, no_sync through engine.no_sync at stage 1, offload through
ZeRO-Offload's offload_optimizer and, at stage 3, offload_param, reshard2 at stage 3 through ZeRO++'s hierarchical
partitioning) to the plain model's
numbers or to a documented deviation with its measured cause (harness/core/policy.py, reports/deepspeed.md), and
refuses what it does not take with DeepSpeed's own reason.

The CI tier (.ci/run installs the deepspeed extra): the first engine of a fresh machine builds a small C++ op."""

from __future__ import annotations

import pytest

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, KNOWN, PASS, UNSUPPORTED
from harness.phases import run_matrix

pytestmark = pytest.mark.ci

STAGES = ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
FEATURES = ("plain", "accum", "clip", "bf16", "no_sync", "offload", "reshard2", "clip_inf", "hsdp", "shard1")
# the documented deviations each stage is expected to show on these cells, and no others
EXPECTED_KNOWN = {
    "ws1_exact",
    "memory_sharding",
    "peak_memory_bound",
    "split_matches_full_batch",
    "grad_norm_matches",
    "cross_ws_replicated",
    "comm_volume",
    "units_gathered",
}


@pytest.fixture(scope="module")
def ds_run(kept_worlds):
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:  # the CI tier installs it: a missing extra is a failure, named
        pytest.fail(f"DeepSpeed is not installed (pip install -e '.[deepspeed]'): {exc}")
    scenarios = build_matrix(STAGES, ["mlp"], [1, 2], ["replicated", "split"], ["adamw"], steps=3, features=FEATURES)
    return run_matrix(scenarios, pool=kept_worlds)


def _mine(res, stage):
    return [v for v in res.verdicts if v.scenario.startswith(stage + "-")]


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_trains_what_it_takes_like_the_plain_model_or_a_documented_deviation(ds_run, stage):
    mine = _mine(ds_run, stage)
    failed = [str(v) for v in mine if v.status == FAIL]
    assert not failed, "\n".join(failed)
    ran = {v.scenario for v in mine if v.check == "completed" and v.status == PASS}
    for feature in ("accum", "clip", "bf16", "offload", *(("reshard2",) if stage == "deepspeed_zero3" else ())):
        assert any(f"-{feature}" in s for s in ran), feature
    assert {v.check for v in mine if v.status == KNOWN} <= EXPECTED_KNOWN
    # accumulation under the engine's own boundaries, and the optimizer stepping the offloaded partitions on the host:
    # bitwise the plain model's at one rank
    for feature in ("accum", "offload"):
        held = [v for v in mine if v.check == "ws1_exact" and v.scenario.endswith(f"-{feature}")]
        assert held and all(v.status == PASS for v in held), [str(v) for v in held]


@pytest.mark.parametrize(
    "stage, feature, says",
    [
        ("deepspeed_zero1", "clip_inf", "L2 norm only"),
        ("deepspeed_zero2", "no_sync", "incompatible with the gradient partitioning"),
        ("deepspeed_zero3", "hsdp", "not hybrid sharding's replicas"),
        ("deepspeed_zero2", "reshard2", "nothing is resharded after forward"),
        ("deepspeed_zero3", "shard1", "flattened elements"),
    ],
)
def test_what_deepspeed_does_not_take_is_unsupported_with_its_reason(ds_run, stage, feature, says):
    cells = [
        v
        for v in _mine(ds_run, stage)
        if v.check == "completed"
        and v.scenario.endswith(f"-{feature}")
        or (v.check == "completed" and f"-{feature}-from" in v.scenario)
    ]
    assert cells and all(v.status == UNSUPPORTED and says in v.message for v in cells), [str(v) for v in cells]


def test_a_stage_resumed_at_another_world_size_through_its_universal_checkpoint_goes_on_like_the_uninterrupted_run(
    kept_worlds,
):
    """ckpt: saved by engine.save_checkpoint at one world size, converted by DeepSpeed's ds_to_universal and loaded
    with load_universal at the other. The resumed run is held to the uninterrupted run's trajectory, and what its
    ranks hold right after loading to what the saver held: DeepSpeed keeps the optimizer state in flat partitions,
    which the adapter's optimizer_state reads back per model parameter (ckpt_restored could not be checked before
    it did)."""
    scenarios = build_matrix(STAGES, ["mlp"], [1, 2], ["replicated"], ["adamw"], steps=4, features=("ckpt",))
    res = run_matrix(scenarios, pool=kept_worlds)
    mine = [v for v in res.verdicts if v.scenario.startswith("deepspeed") and "-ckpt-from" in v.scenario]
    assert {v.scenario for v in mine if v.check == "completed" and v.status == PASS}, "no resumed run finished"
    numbers = [v for v in mine if v.check in ("cross_ws_replicated", "ws1_exact", "converges")]
    assert numbers and all(v.status in (PASS, KNOWN) for v in numbers), [str(v) for v in numbers]
    restored = [v for v in mine if v.check == "ckpt_restored"]
    assert restored and all(v.status == PASS for v in restored), [str(v) for v in restored]
