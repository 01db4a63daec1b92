"""Per-rank state falls as 1/W (memory-only plans in one process, fake process group).

The ideal is computed here from the model's parameter count: AdamW holds params + grads + two
moments, 4 x P bytes, divided by W. The GPT-2-medium-size tier is marked slow (--slow).
"""

import pytest
import torch

from harness.measure.planning import plan_table
from harness.train.models import get_model_spec


def _full_bytes(model: str) -> int:
    with torch.device("meta"):
        m = get_model_spec(model).build()
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _check(model, impls, world_sizes, tolerance):
    ideal_w1 = 4 * _full_bytes(model)
    table = plan_table(model, impls, world_sizes, "adamw")
    assert set(table.impl) == set(impls) and set(table.world_size) == set(world_sizes)
    for row in table.itertuples():
        ideal = ideal_w1 / row.world_size
        assert row.state_total <= ideal * (1 + tolerance), (
            f"{row.impl} W={row.world_size}: {row.state_total} B per rank > ideal {ideal:.0f} B (+{tolerance:.0%})")
        assert row.state_total >= ideal * (1 - 1e-9), f"{row.impl} W={row.world_size}: less state than the ideal?"


def test_fsdp_impl_state_scales_to_64_ranks():
    _check("tinylm", ["fsdp_impl"], [1, 2, 4, 8, 64], tolerance=0.05)


@pytest.mark.slow
def test_gpt2_medium_state_scales_within_one_percent():
    _check("gpt2_medium", ["fsdp_impl", "torch_fsdp2"], [1, 2, 4, 8, 16, 32, 64], tolerance=0.01)
