"""harness/adapters/dtensor_gather.py: the packed gather gives what DTensor.full_tensor() gives, per
parameter, bit for bit: uneven rows (an empty last shard), two dtypes, two meshes' worth of units,
FSDP2's and fsdp_impl's DTensors, and a parameter outside any unit; gathered to rank 0 alone (and fsdp_impl's own
full_state_dict so), the same tensors on rank 0 and nothing on the others."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.adapters.dtensor_gather import full_tensors
from suites.fsdp_impl.worlds.common import shard_each_child

TASK = "suites.harness.unit.test_dtensor_gather:compare"


def _model() -> nn.Module:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Embedding(9, 5), nn.Linear(5, 7), nn.Linear(7, 2))  # 9 and 2 rows: uneven at 3 and 4
    m[2].to(torch.float64)
    m.register_parameter("scale", nn.Parameter(torch.randn(3)))
    return m


def compare(ctx, impl: str) -> dict:
    from torch.distributed.tensor import DTensor

    model = _model()
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_each_child(model, ctx, impl)
    named = list(model.named_parameters())
    got = full_tensors(named)
    one_by_one = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in named}
    out = {
        "names": list(got),
        "order": [n for n, _ in named],
        "same": {n: torch.equal(got[n], one_by_one[n]) and got[n].dtype == one_by_one[n].dtype for n in got},
        "plain": {n: torch.equal(got[n], plain[n]) for n in got},
        # gathered to rank 0 alone (the per-step snapshots): the same tensors there, nothing elsewhere
        "rank0": _same_or_names(full_tensors(named, rank0_only=True), got),
    }
    if impl == "fsdp_impl":
        from fsdp_impl import full_state_dict

        out["impl_rank0"] = _same_or_names(full_state_dict(model, rank0_only=True), full_state_dict(model))
    return out


def _same_or_names(only: dict, every: dict) -> dict | list:
    """Where `only` holds tensors: whether each equals `every`'s (same names, same order, same dtype, bit for bit);
    else its names (none expected)."""
    if not only:
        return []
    return {
        n: list(only) == list(every) and torch.equal(t, every[n]) and t.dtype == every[n].dtype for n, t in only.items()
    }


@pytest.mark.parametrize("impl", ["fsdp2", "fsdp_impl"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_packed_gather_is_full_tensor_per_parameter(world, impl, n):
    results = world(n).call(TASK, impl)
    for r, got in enumerate(results):
        assert got["names"] == got["order"], f"rank {r}"
        assert all(got["same"].values()), f"rank {r}: {got['same']}"
        assert all(got["plain"].values()), f"rank {r}: {got['plain']}"
        assert len(got["names"]) == 6
        for key in ("rank0", "impl_rank0") if impl == "fsdp_impl" else ("rank0",):
            if r == 0:
                assert len(got[key]) == 6 and all(got[key].values()), f"{key}: {got[key]}"
            else:
                assert got[key] == [], f"rank {r}, {key}: {got[key]}"
