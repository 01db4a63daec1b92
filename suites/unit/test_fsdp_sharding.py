"""fsdp_impl.sharding: the pure arithmetic of flat-parameter sharding (no processes, no collectives).

Every expectation is worked out by hand or by a brute-force element-by-element model written
here (a list with one label per flat element), never by calling the function under test twice.
"""

from __future__ import annotations

import math
import random

import pytest

from fsdp_impl.sharding import ALIGN_ELEMENTS, FlatLayout, padded_numel, rank_range, shard_numel

PAD = -1  # label of a flat element that holds no parameter


# ------------------------------------------------------------------------ brute-force model

def brute_offsets(shapes: list[tuple[int, ...]], align: int) -> list[int]:
    """Each parameter starts at the first multiple of `align` at or after the previous end."""
    offsets, cursor = [], 0
    for shape in shapes:
        while cursor % align:
            cursor += 1
        offsets.append(cursor)
        cursor += math.prod(shape)
    return offsets


def brute_labels(shapes: list[tuple[int, ...]], world_size: int, align: int) -> tuple[list[int], int]:
    """(label per element of the padded flat buffer, elements per rank): slot index or PAD."""
    offsets = brute_offsets(shapes, align)
    used = offsets[-1] + math.prod(shapes[-1]) if shapes else 0
    per_rank = 0
    while per_rank * world_size < used:  # the smallest equal shard that covers everything
        per_rank += 1
    labels = [PAD] * (per_rank * world_size)
    for i, (off, shape) in enumerate(zip(offsets, shapes)):
        for e in range(off, off + math.prod(shape)):
            assert labels[e] == PAD
            labels[e] = i
    return labels, per_rank


def runs(chunk: list[int], label: int) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of `label` in `chunk`."""
    out, start = [], None
    for i, v in enumerate(chunk + [object()]):
        if v == label and start is None:
            start = i
        elif v != label and start is not None:
            out.append((start, i))
            start = None
    return out


def layout_of(shapes: list[tuple[int, ...]], world_size: int) -> FlatLayout:
    return FlatLayout.build([(f"p{i}", s) for i, s in enumerate(shapes)], world_size)


# --------------------------------------------------------------------- free functions, by hand

def test_ten_elements_on_three_ranks():
    assert shard_numel(10, 3) == 4  # ceil(10 / 3)
    assert padded_numel(10, 3) == 12
    assert [rank_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]


@pytest.mark.parametrize("total, world, shard", [
    (12, 3, 4), (13, 4, 4), (16, 4, 4), (17, 4, 5), (1, 8, 1), (7, 8, 1), (9, 8, 2), (5, 1, 5), (0, 4, 0),
])
def test_shard_numel_is_ceil_and_padding_below_world_size(total, world, shard):
    assert shard_numel(total, world) == shard
    assert padded_numel(total, world) == shard * world
    assert 0 <= padded_numel(total, world) - total < max(world, 1)


def test_rank_ranges_tile_the_padded_buffer():
    for total in range(0, 40):
        for world in range(1, 9):
            ranges = [rank_range(total, world, r) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == padded_numel(total, world)
            for (a, b), (c, d) in zip(ranges, ranges[1:]):
                assert b == c  # contiguous, no overlap, no hole
            assert len({b - a for a, b in ranges}) == 1  # equal sizes: all-gather needs it


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_below_one_is_rejected(world):
    with pytest.raises(ValueError, match="world_size"):
        shard_numel(10, world)


# ------------------------------------------------------------------------------ layout by hand

def test_alignment_constant_is_a_power_of_two():
    assert ALIGN_ELEMENTS >= 1 and ALIGN_ELEMENTS & (ALIGN_ELEMENTS - 1) == 0


def test_single_ten_element_parameter_on_three_ranks():
    layout = layout_of([(10,)], 3)
    assert [s.offset for s in layout.slots] == [0] and layout.slots[0].end == 10
    assert (layout.used_numel, layout.shard_numel, layout.padded_numel) == (10, 4, 12)
    assert [layout.rank_range(r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    # ranks 0 and 1 hold parameter elements only; rank 2 holds elements 8, 9 then two pads
    assert layout.padding_mask_ranges(0) == []
    assert layout.padding_mask_ranges(1) == []
    assert layout.padding_mask_ranges(2) == [(2, 4)]
    slot = layout.slots[0]
    assert [layout.overlap(slot, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]


def test_second_parameter_starts_at_the_next_aligned_element():
    # (3,) then (5,): with 16-element alignment the second starts at 16, the layout uses 21
    layout = FlatLayout.build([("a", (3,)), ("b", (5,))], 2)
    if ALIGN_ELEMENTS != 16:
        pytest.skip("hand-computed for 16-element alignment")
    a, b = layout.slots
    assert (a.offset, a.end, b.offset, b.end) == (0, 3, 16, 21)
    assert (layout.used_numel, layout.shard_numel, layout.padded_numel) == (21, 11, 22)
    # rank 0 owns [0, 11): a at 0..2, gap 3..10; rank 1 owns [11, 22): gap 11..15, b 16..20, pad 21
    assert layout.padding_mask_ranges(0) == [(3, 11)]
    assert layout.padding_mask_ranges(1) == [(0, 5), (10, 11)]
    assert layout.overlap(a, 0) == (0, 3) and layout.overlap(a, 1) is None
    assert layout.overlap(b, 0) is None and layout.overlap(b, 1) == (16, 21)


def test_uneven_linear_layer_layout():
    # nn.Linear(13, 37): weight 481 elements, bias 37; bias starts at 496 (= 31 x 16)
    if ALIGN_ELEMENTS != 16:
        pytest.skip("hand-computed for 16-element alignment")
    layout = FlatLayout.build([("weight", (37, 13)), ("bias", (37,))], 3)
    assert [s.offset for s in layout.slots] == [0, 496]
    assert layout.used_numel == 533
    assert (layout.shard_numel, layout.padded_numel) == (178, 534)  # ceil(533 / 3) = 178
    assert [layout.rank_range(r) for r in range(3)] == [(0, 178), (178, 356), (356, 534)]
    # rank 2 owns [356, 534): weight 356..480, gap 481..495, bias 496..532, one pad 533
    assert layout.padding_mask_ranges(2) == [(481 - 356, 496 - 356), (533 - 356, 534 - 356)]
    assert layout.overlap(layout.slots[1], 2) == (496, 533)
    assert layout.overlap(layout.slots[1], 0) is None


def test_world_size_one_has_only_alignment_gaps():
    layout = layout_of([(16,), (4,), (2, 2)], 1)
    if ALIGN_ELEMENTS != 16:
        pytest.skip("hand-computed for 16-element alignment")
    assert [s.offset for s in layout.slots] == [0, 16, 32]
    assert layout.shard_numel == layout.padded_numel == layout.used_numel == 36
    assert layout.padding_mask_ranges(0) == [(20, 32)]


def test_empty_layout():
    layout = FlatLayout.build([], 4)
    assert (layout.used_numel, layout.shard_numel, layout.padded_numel) == (0, 0, 0)


def test_slot_records_name_and_shape():
    layout = FlatLayout.build([("blocks.0.w", (3, 4)), ("b", ())], 2)
    assert [(s.fqn, s.shape, s.numel) for s in layout.slots] == [("blocks.0.w", (3, 4), 12), ("b", (), 1)]


# ------------------------------------------------------------------- layout against brute force

def _random_cases(n: int) -> list[tuple[list[tuple[int, ...]], int]]:
    rng = random.Random(20240617)
    cases = []
    for _ in range(n):
        shapes = []
        for _ in range(rng.randint(1, 5)):
            dims = rng.randint(0, 3)
            shapes.append(tuple(rng.randint(1, 9) for _ in range(dims)))
        cases.append((shapes, rng.randint(1, 8)))
    cases += [([(10,)], 3), ([(1,)], 8), ([(16,), (16,)], 2), ([(17,), (1,), (33,)], 7), ([(37, 13), (37,)], 4)]
    return cases


@pytest.mark.parametrize("shapes, world", _random_cases(60))
def test_layout_matches_element_by_element_model(shapes, world):
    labels, per_rank = brute_labels(shapes, world, ALIGN_ELEMENTS)
    layout = layout_of(shapes, world)
    assert [s.offset for s in layout.slots] == brute_offsets(shapes, ALIGN_ELEMENTS)
    assert [s.numel for s in layout.slots] == [math.prod(s) for s in shapes]
    assert layout.shard_numel == per_rank
    assert layout.padded_numel == len(labels)
    for r in range(world):
        lo, hi = r * per_rank, (r + 1) * per_rank
        assert layout.rank_range(r) == (lo, hi)
        chunk = labels[lo:hi]
        assert layout.padding_mask_ranges(r) == runs(chunk, PAD), f"rank {r}"
        for i, slot in enumerate(layout.slots):
            mine = runs(chunk, i)
            assert len(mine) <= 1  # a parameter's elements on one rank are contiguous
            expected = (mine[0][0] + lo, mine[0][1] + lo) if mine else None
            assert layout.overlap(slot, r) == expected, f"slot {i} rank {r}"


@pytest.mark.parametrize("shapes, world", _random_cases(30))
def test_every_parameter_element_is_owned_by_exactly_one_rank(shapes, world):
    layout = layout_of(shapes, world)
    for slot in layout.slots:
        owned = 0
        for r in range(world):
            span = layout.overlap(slot, r)
            if span is not None:
                lo, hi = layout.rank_range(r)
                assert lo <= span[0] < span[1] <= hi
                owned += span[1] - span[0]
        assert owned == slot.numel
    # parameter elements + padding elements = the whole padded buffer
    pad = sum(b - a for r in range(world) for a, b in layout.padding_mask_ranges(r))
    assert sum(s.numel for s in layout.slots) + pad == layout.padded_numel
