"""CUDA / NCCL paths (skipped without a GPU; CI has none): run on a GPU box with
`python -m pytest suites/test_cuda.py`.

- The matrix at world size 1 over NCCL: every check, and bitwise equality with the plain model
  (cuBLAS picks the same kernels for the same shapes in one process, so equal is the bar).
- fsdp_impl's mixed-precision policy on CUDA (bf16 compute, fp32 reduce and master shards) against
  FSDP2's with the same policy, model and data.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.core.scenario import build_matrix
from harness.execute.executor import run_matrix
from harness.execute.world import World

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BF16_EPS = 2.0 ** -8  # bf16 keeps 8 significant bits


@pytest.fixture(scope="module")
def cuda_run():
    scenarios = build_matrix(["fsdp_impl", "torch_fsdp2"], ["mlp", "tinylm"], [1], ["replicated"],
                             ["adamw", "sgd"], backend="nccl")
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
        return {impl: world.call("suites.cuda_tasks:bf16_training", {"impl": impl, "model": "tinylm", "steps": 5})[0]
                for impl in ("fsdp_impl", "torch_fsdp2")}


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
