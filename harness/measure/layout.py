"""Where a rank's parameters lie in the full ones: the dim-0 rows of each parameter it holds, read from the DTensor's
own spec (the implementation is not asked). The tables place a run's parting from its yardstick on the ranks that
hold those rows (harness.tables.build, rank_diffs), and the localiser's tracer records them beside its state."""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def rows_held(wrapped) -> dict[str, list[int]]:
    """parameter name -> [first, stop) of the dim-0 rows this rank holds of it, for every DTensor parameter
    laid out by rows (Shard(0) or Replicate on each mesh dimension), read from the DTensor's own spec; none
    for plain tensors (a whole copy on every rank) or other placements. Lets the parent tell which ranks
    hold the rows where a run parted from its yardstick (harness.tables.build, rank_diffs)."""
    out = {}
    for name, p in wrapped.named_parameters():
        if not isinstance(p, DTensor) or p.dim() == 0:
            continue
        if not all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements):
            continue
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[name] = [int(offset[0]), int(offset[0]) + int(shape[0])]
    return out
