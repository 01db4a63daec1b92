"""Stateless collectives on flat buffers. The math (sum, divide) is kept apart from the wiring."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group) -> None:
    """Fill `out` (1D, padded, shard.numel() x W) with every rank's `shard`, in rank order."""
    if dist.get_world_size(group) == 1:
        out.copy_(shard)
        return
    dist.all_gather_single(out, shard.contiguous(), group=group)


def reduce_scatter_mean(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of the mean over ranks of `full_grad` (1D, padded), accumulated in `reduce_dtype`.

    The reduce-scatter is an all-to-all exchange in the gradient's own dtype (each rank receives
    every rank's copy of its own shard: (W-1)/W of the buffer on the wire, as a ring reduce-scatter)
    followed by a local sum in rank order 0..W-1. The order is fixed whatever algorithm the backend
    picks, so results are deterministic; summing in a wider dtype makes the sum of W fp32 addends
    exact (W identical addends give exactly W x g, so replicated data at any W is bitwise equal to
    one rank) and the split-data mean correctly rounded. The division by W happens in the wide dtype.
    """
    world = dist.get_world_size(group)
    if world == 1:
        return full_grad.to(reduce_dtype)
    send = full_grad.contiguous()
    recv = torch.empty_like(send)  # W chunks: chunk j is rank j's gradient for this rank's shard
    dist.all_to_all_single(recv, send, group=group)
    return sum_in_rank_order(recv.view(world, -1), reduce_dtype).div_(world)


def sum_in_rank_order(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts: (W, shard). Row 0 + row 1 + ... in `dtype`, one row at a time (no tree, no reordering)."""
    out = parts[0].to(dtype, copy=True)
    for j in range(1, parts.shape[0]):
        out.add_(parts[j])
    return out
