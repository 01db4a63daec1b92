"""CUDA / NCCL paths (skipped without a GPU; CI has none): run on a GPU box with
`python -m pytest suites/harness/end_to_end/test_cuda.py`.

- The matrix at world size 1 over NCCL: every check, and bitwise equality with the plain model
  (cuBLAS picks the same kernels for the same shapes in one process, so equal is the bar).
- fsdp_impl's mixed-precision policy on CUDA (bf16 compute, fp32 reduce and master shards) against
  FSDP2's with the same policy, model and data.
- Feature offload over NCCL (state in host memory, the optimizer step on the CPU): every check, bitwise the
  plain model doing the same at one rank, and offload_host measured (not skipped) and passing; an adapter
  whose wrap_offload ignores the policy fails offload_host (the check can fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.core.scenario import build_matrix
from harness.execute.world import World
from harness.phases import run_matrix

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BF16_EPS = 2.0**-8  # bf16 keeps 8 significant bits


@pytest.fixture(scope="module")
def cuda_run():
    scenarios = build_matrix(
        ["fsdp_impl", "torch_fsdp2"], ["mlp", "tinylm"], [1], ["replicated"], ["adamw", "sgd"], backend="nccl"
    )
    return run_matrix(scenarios, timeout_s=600)


def test_no_check_fails_over_nccl(cuda_run):
    assert all(not r.get("error") for r in cuda_run.records.values()), cuda_run.records
    failed = [str(v) for v in cuda_run.verdicts if v.status == "fail"]
    assert not failed, "\n".join(failed)


def test_fsdp_impl_at_one_rank_is_bitwise_the_plain_model_on_cuda(cuda_run):
    exact = [v for v in cuda_run.verdicts if v.check == "ws1_exact" and v.scenario.startswith("fsdp_impl-")]
    assert len(exact) == 4 and all(v.status == "pass" for v in exact), [str(v) for v in exact]


@pytest.fixture(scope="module")
def bf16():
    with World(1, "nccl", timeout_s=600) as world:
        return {
            impl: world.call(
                "suites.harness.end_to_end.cuda_tasks:bf16_training", {"impl": impl, "model": "tinylm", "steps": 5}
            )[0]
            for impl in ("fsdp_impl", "torch_fsdp2")
        }


@pytest.mark.parametrize("impl", ["fsdp_impl", "torch_fsdp2"])
def test_bf16_policy_computes_in_bf16_and_keeps_fp32_shards_on_the_gpu(bf16, impl):
    got = bf16[impl]
    assert got["out_dtypes"] == ["torch.bfloat16"] and got["shard_dtypes"] == ["torch.float32"]
    assert got["devices"] == ["cuda"]
    assert all(math.isfinite(v) for v in got["losses"]) and got["losses"][-1] < got["losses"][0]


def test_bf16_first_loss_of_fsdp_impl_matches_fsdp2(bf16):
    """Same fp32 weights cast to bf16, same data: the first forward differs at most by bf16 rounding."""
    a, b = bf16["fsdp_impl"]["losses"][0], bf16["torch_fsdp2"]["losses"][0]
    assert abs(a - b) <= BF16_EPS * abs(b), (a, b)


OFFLOAD_FEATURES = ["offload", "offload+clip", "offload+accum", "offload+ckpt"]
IGNORED = "suites.harness.end_to_end.cuda_tasks:OffloadIgnored"


@pytest.fixture(scope="module")
def offload_run():
    scenarios = build_matrix(
        ["fsdp_impl", "torch_fsdp2", IGNORED],
        ["mlp", "tinylm_tied"],
        [1],
        ["replicated"],
        ["adamw", "sgd"],
        backend="nccl",
        steps=3,
        features=OFFLOAD_FEATURES,
    )
    return run_matrix(scenarios, timeout_s=600)


def _of(run, impl: str, check: str):
    impl_of = {s.id: s.impl for s in run.scenarios}
    return [v for v in run.verdicts if v.check == check and impl_of.get(v.scenario) == impl]


def test_offload_passes_every_check_over_nccl(offload_run):
    assert all(not r.get("error") for r in offload_run.records.values()), offload_run.records
    ignored = {s.id for s in offload_run.scenarios if s.impl == IGNORED}
    failed = [str(v) for v in offload_run.verdicts if v.status == "fail" and v.scenario not in ignored]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("impl", ["fsdp_impl", "torch_fsdp2"])
def test_offload_leaves_no_state_on_the_device_and_loses_none(offload_run, impl):
    held = _of(offload_run, impl, "offload_host")
    assert len(held) == 2 * 2 * len(OFFLOAD_FEATURES), [str(v) for v in held]
    assert all(v.status == "pass" for v in held), [str(v) for v in held]


def test_fsdp_impl_offloaded_is_bitwise_the_plain_model_offloaded(offload_run):
    exact = _of(offload_run, "fsdp_impl", "ws1_exact")
    assert exact and all(v.status == "pass" and v.measured == 0 for v in exact), [str(v) for v in exact]


def test_an_offload_that_keeps_the_state_on_the_device_fails(offload_run):
    held = _of(offload_run, IGNORED, "offload_host")
    assert held and all(v.status == "fail" for v in held), [str(v) for v in held]


@pytest.mark.parametrize("name", ["bf16_optimizer_step", "offload_stale_host_copy"])
def test_the_localiser_names_a_mutants_defect_over_nccl(name):
    """Replayed at one rank over NCCL with every op traced on the device, a mutant's defect is named where it is
    on the CPU: its phase and module (the tracer compares each device output with the CPU copies it keeps)."""
    import dataclasses

    from harness.localize.replay import localize
    from suites.mutants.catalog import CATALOGUE
    from suites.mutants.localised import WHERE, cell

    mutant = next(m for m in CATALOGUE if m.name == name)
    found = localize(dataclasses.replace(cell(mutant), world_size=1, backend="nccl"))
    assert found.diverged, "\n".join(found.lines())
    assert (found.point.phase, found.point.module) == WHERE[name], "\n".join(found.lines())
