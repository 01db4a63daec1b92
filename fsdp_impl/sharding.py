"""Pure arithmetic of flat-parameter sharding: layout, padding, per-rank ranges. No communication."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Every parameter starts at a multiple of this many elements inside the flat buffer, so each
# unsharded view is as aligned as a freshly allocated tensor (BLAS kernels may pick different
# code paths for unaligned pointers, which would break bitwise equality with the plain model).
ALIGN_ELEMENTS = 16


def shard_numel(total: int, world_size: int) -> int:
    """Elements per rank under uniform padding: ceil(total / W)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return math.ceil(total / world_size)


def padded_numel(total: int, world_size: int) -> int:
    """Length of the padded flat buffer: shard_numel x W (all-gather needs equal shards)."""
    return shard_numel(total, world_size) * world_size


def rank_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the flat (padded) buffer that `rank` owns."""
    n = shard_numel(total, world_size)
    return rank * n, (rank + 1) * n


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives in the flat buffer."""

    fqn: str  # name relative to the unit's module, e.g. "attn.wq.weight"
    shape: tuple[int, ...]
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """Parameters laid end to end (each aligned), then zero padding up to shard x W."""

    slots: tuple[ParamSlot, ...]
    world_size: int

    @classmethod
    def build(cls, named_shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> "FlatLayout":
        slots, offset = [], 0
        for fqn, shape in named_shapes:
            offset = -(-offset // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
            numel = math.prod(shape)
            slots.append(ParamSlot(fqn, tuple(shape), offset, numel))
            offset += numel
        return cls(tuple(slots), world_size)

    @property
    def used_numel(self) -> int:
        """Elements up to the end of the last parameter (alignment gaps included)."""
        return self.slots[-1].end if self.slots else 0

    @property
    def shard_numel(self) -> int:
        return shard_numel(self.used_numel, self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def rank_range(self, rank: int) -> tuple[int, int]:
        return rank_range(self.used_numel, self.world_size, rank)

    def overlap(self, slot: ParamSlot, rank: int) -> tuple[int, int] | None:
        """[start, end) of `slot` (in flat coordinates) that `rank` owns, or None."""
        lo, hi = self.rank_range(rank)
        start, end = max(lo, slot.offset), min(hi, slot.end)
        return (start, end) if start < end else None

    def padding_mask_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Ranges, local to `rank`'s shard, that hold no parameter element (alignment gaps and tail padding)."""
        lo, hi = self.rank_range(rank)
        gaps, cursor = [], lo
        for slot in self.slots:
            if slot.offset > cursor:
                gaps.append((cursor, min(slot.offset, hi)))
            cursor = max(cursor, slot.end)
            if cursor >= hi:
                break
        if cursor < hi:
            gaps.append((cursor, hi))
        return [(a - lo, b - lo) for a, b in gaps if a < b and a < hi and b > lo]
