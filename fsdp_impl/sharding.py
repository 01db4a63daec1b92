"""Pure arithmetic of per-parameter dim-0 sharding. No tensors, no communication.

A parameter of R rows (its dim 0; a row is the rest of its shape) is cut over W ranks the way
``torch.chunk`` and DTensor's ``Shard(0)`` cut it: every rank gets a chunk of ceil(R / W) rows,
the last ranks fewer, possibly none. Rank r holds rows [r * c, min((r + 1) * c, R)).

For communication every rank's chunk is padded to the full c rows (zero rows after its own), so
that each rank sends and receives the same number of elements: the all-gather output and the
reduce-scatter input of a parameter are W x c rows, of which the first R are the parameter.
"""

from __future__ import annotations


def chunk_rows(rows: int, world_size: int) -> int:
    """Rows of a full (padded) chunk: ceil(rows / W)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return -(-rows // world_size)


def row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of the rows `rank` holds (start == end: an empty shard)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0 .. {world_size - 1}")
    c = chunk_rows(rows, world_size)
    start = min(rank * c, rows)
    return start, min(start + c, rows)


def local_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows `rank` holds: c for the first ranks, fewer (or 0) at the end."""
    start, end = row_range(rows, world_size, rank)
    return end - start


def padded_rows(rows: int, world_size: int) -> int:
    """Rows of the padded full tensor the collectives move: c x W (>= rows, < rows + W)."""
    return chunk_rows(rows, world_size) * world_size
