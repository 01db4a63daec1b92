"""Per-rank state falls as 1/W (memory-only plans in one process, fake process group).

The ideal is computed here from the model's parameter count: AdamW holds params + grads + two
moments, 4 x P bytes, divided by W. Per-parameter dim-0 sharding (fsdp_impl, FSDP2) hands out
whole rows: rank 0 holds ceil(R / W) rows of each parameter, up to one row more than R / W, so the
allowance is one dim-0 row per parameter and state category beside the relative tolerance (at 64
ranks a tinylm weight of 32 rows is 1 row on rank 0 where the ideal is half a row). The
GPT-2-medium-size tier is marked slow (--slow).
"""

import pytest
import torch

from harness.plan.table import plan_table
from harness.train.models import get_model_spec


def _full_bytes(model: str) -> int:
    with torch.device("meta"):
        m = get_model_spec(model).build()
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _row_bytes(model: str) -> int:
    """One dim-0 row of every parameter, in bytes."""
    with torch.device("meta"):
        m = get_model_spec(model).build()
    return sum(p[0].numel() * p.element_size() if p.dim() else p.element_size() for p in m.parameters())


def _check(model, impls, world_sizes, tolerance):
    ideal_w1 = 4 * _full_bytes(model)
    rows = 4 * _row_bytes(model)  # params, grads and two moments: one row each per parameter at most
    table = plan_table(model, impls, world_sizes, "adamw")
    assert set(table.impl) == set(impls) and set(table.world_size) == set(world_sizes)
    for row in table.itertuples():
        ideal = ideal_w1 / row.world_size
        assert row.state_total <= ideal * (1 + tolerance) + rows, (
            f"{row.impl} W={row.world_size}: {row.state_total} B per rank > ideal {ideal:.0f} B (+{tolerance:.0%} "
            f"+ one row per parameter and category, {rows} B)"
        )
        assert row.state_total >= ideal * (1 - 1e-9), f"{row.impl} W={row.world_size}: less state than the ideal?"
    return table


def test_fsdp_impl_state_scales_to_64_ranks():
    table = _check("tinylm", ["fsdp_impl", "torch_fsdp2"], [1, 2, 4, 8, 64], tolerance=0.05)
    # the same per-parameter layout as FSDP2: the same bytes per rank in every category
    cols = ["world_size", "params", "grads", "optimizer_state"]
    ours, theirs = (table[table.impl == i][cols].reset_index(drop=True) for i in ("fsdp_impl", "torch_fsdp2"))
    assert ours.equals(theirs), f"fsdp_impl:\n{ours}\nFSDP2:\n{theirs}"


@pytest.mark.slow
def test_gpt2_medium_state_scales_within_one_percent():
    _check("gpt2_medium", ["fsdp_impl", "torch_fsdp2"], [1, 2, 4, 8, 16, 32, 64], tolerance=0.01)
