"""fsdp_impl.sharding: the pure arithmetic of per-parameter dim-0 sharding (no processes, no collectives),
and the agreement of the three places that must cut a parameter alike: our row ranges (which rows a
rank holds), DTensor's Shard(0) (what the DTensor says the rank holds) and ``torch._chunk_cat``
(which rows the gradient reduction sends to each rank).

Every expectation is worked out by hand or by a brute-force row-by-row model written here (a list
with one owner per row), never by calling the function under test twice.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Shard

from fsdp_impl.sharding import chunk_rows, local_rows, padded_rows, row_range

# ------------------------------------------------------------------------ brute-force model


def brute_owners(rows: int, world: int) -> tuple[list[int], int]:
    """(owner rank of every row, rows per padded chunk): the smallest equal chunk that covers all
    rows, chunks handed out in rank order."""
    per_rank = 0
    while per_rank * world < rows:
        per_rank += 1
    return [row // per_rank for row in range(rows)], per_rank


# --------------------------------------------------------------------------------- by hand


def test_ten_rows_on_three_ranks():
    assert chunk_rows(10, 3) == 4  # ceil(10 / 3)
    assert padded_rows(10, 3) == 12
    assert [row_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [local_rows(10, 3, r) for r in range(3)] == [4, 4, 2]


def test_a_rank_may_hold_no_row():
    # 5 rows on 4 ranks: chunks of 2, the last rank empty; 7 rows on 8 ranks: one each, rank 7 empty
    assert [row_range(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [local_rows(7, 8, r) for r in range(8)] == [1] * 7 + [0]
    # 9 rows on 8 ranks: chunks of 2, ranks 5, 6, 7 empty
    assert [local_rows(9, 8, r) for r in range(8)] == [2, 2, 2, 2, 1, 0, 0, 0]


@pytest.mark.parametrize(
    "rows, world, chunk",
    [
        (12, 3, 4),
        (13, 4, 4),
        (16, 4, 4),
        (17, 4, 5),
        (1, 8, 1),
        (7, 8, 1),
        (9, 8, 2),
        (5, 1, 5),
        (0, 4, 0),
    ],
)
def test_chunk_is_ceil_and_padding_below_world_size(rows, world, chunk):
    assert chunk_rows(rows, world) == chunk
    assert padded_rows(rows, world) == chunk * world
    assert 0 <= padded_rows(rows, world) - rows < max(world, 1) * max(chunk, 1)


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_below_one_is_rejected(world):
    with pytest.raises(ValueError, match="world_size"):
        chunk_rows(10, world)


def test_rank_outside_the_world_is_rejected():
    with pytest.raises(ValueError, match="rank 3"):
        row_range(10, 3, 3)


# ------------------------------------------------------------------- against brute force


def _random_cases(n: int) -> list[tuple[int, int]]:
    rng = random.Random(20240617)
    return [(rng.randint(0, 70), rng.randint(1, 9)) for _ in range(n)] + [(61, 4), (61, 8), (7, 8), (1, 8), (37, 3)]


@pytest.mark.parametrize("rows, world", _random_cases(60))
def test_row_ranges_match_the_row_by_row_model(rows, world):
    owners, per_rank = brute_owners(rows, world)
    assert chunk_rows(rows, world) == per_rank
    for r in range(world):
        mine = [i for i, o in enumerate(owners) if o == r]
        start, end = row_range(rows, world, r)
        assert list(range(start, end)) == mine, f"rank {r}"
        assert local_rows(rows, world, r) == len(mine) <= per_rank
    # the ranges tile the rows: every row on exactly one rank, in rank order
    assert sum(local_rows(rows, world, r) for r in range(world)) == rows


@pytest.mark.parametrize("rows, world", _random_cases(40))
def test_dtensor_shard0_holds_the_same_rows(rows, world):
    """What the DTensor claims a rank holds (its local size and offset on dim 0) is our row range."""
    for r in range(world):
        size, offset = Shard(0)._local_shard_size_and_offset(rows, world, r)
        start, end = row_range(rows, world, r)
        assert size == end - start, f"rank {r}"
        if size:
            assert offset == start, f"rank {r}"


@pytest.mark.parametrize(
    "shapes, world",
    [
        ([(7, 3), (5,)], 4),
        ([(37, 13), (37,)], 3),
        ([(61, 32), (8, 4, 2)], 8),
        ([(1,), (2, 2)], 2),
        ([(9, 2)], 1),
    ],
)
def test_chunk_cat_sends_each_rank_its_rows(shapes, world):
    """The reduction's send buffer (torch._chunk_cat, as group.py builds it): row r of it holds, for
    every parameter in order, rank r's rows followed by zero rows up to the chunk."""
    tensors = [torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float32).view(s[0], -1) for s in shapes]
    out = torch._chunk_cat(tensors, dim=0, num_chunks=world)
    assert out.shape == (world, sum(chunk_rows(t.shape[0], world) * t.shape[1] for t in tensors))
    for r in range(world):
        expected = []
        for t in tensors:
            start, end = row_range(t.shape[0], world, r)
            pad = chunk_rows(t.shape[0], world) - (end - start)
            expected.append(torch.cat([t[start:end].reshape(-1), torch.zeros(pad * t.shape[1])]))
        assert torch.equal(out[r], torch.cat(expected)), f"rank {r}"


def test_a_reduction_at_world_size_one_skips_only_casts_that_change_no_value():
    """The mean over one rank is the gradient itself: the cast to reduce_dtype is skipped where every
    value of the gradient's dtype is one of reduce_dtype's, and kept where it rounds (a bf16 reduce
    of fp32 gradients must still round them, as the policy asks)."""
    from fsdp_impl.collectives import holds_exactly

    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    for wide, narrow in [(f64, f32), (f64, bf16), (f64, f16), (f32, bf16), (f32, f16), (f32, f32)]:
        assert holds_exactly(wide, narrow), (wide, narrow)
    for wide, narrow in [(f32, f64), (bf16, f32), (f16, f32), (bf16, f16), (f16, bf16)]:
        assert not holds_exactly(wide, narrow), (wide, narrow)
    x = torch.tensor([1 + 2**-20, 3e38, 1e-40], dtype=f32)  # rounds in bf16; overflows fp16; subnormal
    for wide in (f64, f32):
        assert torch.equal(x.to(wide).to(f32), x)
    assert not torch.equal(x.to(bf16).to(f32), x) and not torch.equal(x.to(f16).to(f32), x)


@pytest.mark.parametrize("block", [1, 7, 1 << 15])
def test_the_blocked_rank_order_mean_is_the_whole_row_mean_bit_for_bit(monkeypatch, block):
    """in_rank_order sums rows 0..W-1 in float64 block by block: every element sees the same
    operations as in one whole-row sum (row 0 widened, each row added in order, divided, rounded
    once), whatever the block size; ranks' gradients of very different magnitudes included."""
    from fsdp_impl import collectives

    monkeypatch.setattr(collectives, "BLOCK", block)
    gen = torch.Generator().manual_seed(5)
    parts = torch.randn(3, 1001, generator=gen) * torch.tensor([[1.0], [1e-6], [1e7]])
    want = parts[0].double()
    for j in (1, 2):
        want = want + parts[j].double()
    want = (want / 3).float()
    got = collectives.in_rank_order(parts, torch.float64, torch.float32, divisor=3)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    summed = collectives.sum_in_rank_order(parts, torch.float64)
    assert summed.dtype == torch.float64 and torch.equal(summed, parts[0].double() + parts[1] + parts[2])
