"""Stateless collectives on flat buffers. The math (sum, divide) is kept apart from the wiring.

A unit's gradient reaches them as ONE flat buffer of W equal chunks, chunk r holding every
parameter's rows for rank r (group.py builds it with ``torch._chunk_cat``); what comes back is this
rank's chunk, reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tree import tree_sum_rows


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather_single`` (torch >= 2.13), or its older name ``all_gather_into_tensor``, which torch 2.13
    deprecates and earlier releases have alone (a GPU box may keep an older torch)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=async_op)


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """Fill `out` (1D, padded, shard.numel() x W) with every rank's `shard`, in rank order.
    With `async_op` the collective is only issued: the returned work's ``wait()`` completes it
    (None at world size 1, where the copy is done at once); `shard` must stay alive until then."""
    if dist.get_world_size(group) == 1:
        out.copy_(shard)
        return None
    return all_gather_single(out, shard.contiguous(), group=group, async_op=async_op)


def gather_flat(out: torch.Tensor | None, shard: torch.Tensor, group) -> None:
    """Fill `out` (1D, padded, shard.numel() x W) with every rank's `shard`, in rank order, on the group's first
    rank alone; the other ranks only send theirs (`out` None there) and go on. A gather, not an all-gather: one
    hop to the first rank instead of W - 1 around the ring."""
    world = dist.get_world_size(group)
    if world == 1:
        out.copy_(shard)
        return
    chunks = list(out.view(world, -1).unbind(0)) if out is not None else None
    dist.gather(shard.contiguous(), chunks, dst=dist.get_global_rank(group, 0), group=group)


def reduce_scatter_mean(
    full_grad: torch.Tensor, group, reduce_dtype: torch.dtype, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """This rank's chunk of the mean over ranks of `full_grad` (1D, W equal chunks), accumulated in
    `reduce_dtype` and returned in `out_dtype` (default `reduce_dtype`).

    The reduce-scatter is an all-to-all exchange in the gradient's own dtype (each rank receives
    every rank's copy of its own shard: (W-1)/W of the buffer on the wire, as a ring reduce-scatter)
    followed by a local sum in rank order 0..W-1. The order is fixed whatever algorithm the backend
    picks, so results are deterministic; summing in a wider dtype makes the sum of W fp32 addends
    exact (W identical addends give exactly W x g, so replicated data at any W is bitwise equal to
    one rank) and the split-data mean correctly rounded. The division by W happens in the wide
    dtype, then one rounding to `out_dtype` (``in_rank_order``, block by block).
    """
    world = dist.get_world_size(group)
    if world == 1:  # the mean of one addend: only casts, skipped where they cannot change a value
        mean = full_grad if holds_exactly(reduce_dtype, full_grad.dtype) else full_grad.to(reduce_dtype)
        return mean.to(out_dtype or reduce_dtype)
    return _exchanged_sum(full_grad, group, reduce_dtype, out_dtype or reduce_dtype, divisor=world)


def _exchanged_sum(
    full_grad: torch.Tensor, group, dtype: torch.dtype, out_dtype: torch.dtype, divisor: int | None = None
) -> torch.Tensor:
    """The all-to-all (chunk j received: rank j's copy of this rank's chunk), then ``in_rank_order``."""
    recv = torch.empty_like(full_grad, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, full_grad.contiguous(), group=group)
    out = in_rank_order(recv.view(dist.get_world_size(group), -1), dtype, out_dtype, divisor)
    recv.untyped_storage().resize_(0)  # now, not when the backend lets go of its work
    return out


def reduce_scatter_tree(full_grad: torch.Tensor, group, dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunk of the SUM over ranks of `full_grad` (1D, W equal chunks; W a power of two), the ranks'
    copies added in the fixed binary tree over the rank index ((0 + 1) + (2 + 3), ...) in `dtype`, with no
    division: the upper levels of batch-invariant training's tree (invariant.py, tree.py). A new tensor."""
    world = dist.get_world_size(group)
    if world == 1:
        return full_grad.to(dtype, copy=True)
    recv = torch.empty_like(full_grad, memory_format=torch.contiguous_format)
    dist.all_to_all_single(recv, full_grad.contiguous(), group=group)
    out = tree_sum_rows(recv.view(world, -1).to(dtype))
    recv.untyped_storage().resize_(0)
    return out


def holds_exactly(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """True when every `narrow` value is a `wide` value (the cast there and back is the identity)."""
    if wide == narrow:
        return True
    if not (wide.is_floating_point and narrow.is_floating_point):
        return False
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.bits > n.bits and w.eps <= n.eps and w.max >= n.max and w.tiny <= n.tiny


def reduce_scatter_sum(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard of the SUM over ranks of `full_grad`, in `reduce_dtype` (no division):
    the all-to-all and rank-ordered sum of ``reduce_scatter_mean``. A new tensor, never `full_grad`."""
    world = dist.get_world_size(group)
    if world == 1:
        return full_grad.to(reduce_dtype, copy=True)
    return _exchanged_sum(full_grad, group, reduce_dtype, reduce_dtype)


def hybrid_reduce_mean(
    full_grad: torch.Tensor,
    shard_group,
    replicate_group,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """HSDP: this rank's shard of the mean of `full_grad` over all R x S ranks (S in `shard_group`,
    R in `replicate_group`), in `reduce_dtype`.

    Sum over the shard group (``reduce_scatter_sum``), then sum those partial sums across the
    replicas in rank order (still in `reduce_dtype`) and divide by R x S once. Nothing is rounded to the
    gradient's dtype before the division: with fp32 gradients and the default fp64 `reduce_dtype`,
    R x S identical addends sum exactly to R x S x g, so replicated data is bitwise equal to one rank,
    and the split-data mean is the fp64 sum of the R x S gradients (exact for addends of similar
    magnitude), divided and rounded once (to `out_dtype`, default `reduce_dtype`). The replica exchange is
    an all-reduce spelled out as an all-to-all, each rank summing, dividing and rounding its chunk once,
    and an all-gather of the rounded chunks, so every rank holds the same bits. It carries the partial sums
    in `reduce_dtype` (fp64 by default: twice the bytes of an fp32 exchange); with one rank a shard group
    (S = 1) the partial sum is the rank's own gradient, which its own dtype holds exactly, so it travels in
    that dtype and is widened only where it is summed (a narrower `reduce_dtype` rounds it before it travels).
    """
    out_dtype = out_dtype or reduce_dtype
    count = dist.get_world_size(shard_group) * dist.get_world_size(replicate_group)
    if dist.get_world_size(shard_group) == 1 and holds_exactly(reduce_dtype, full_grad.dtype):
        partial = full_grad.reshape(-1)
    else:
        partial = reduce_scatter_sum(full_grad, shard_group, reduce_dtype)
    replicas = dist.get_world_size(replicate_group)
    n = partial.numel()
    chunk = -(-n // replicas)
    if chunk * replicas == n:
        send = partial.contiguous()
    else:
        send = torch.zeros(chunk * replicas, dtype=partial.dtype, device=partial.device)
        send[:n] = partial
    del partial  # a partial sum of the shard group's is freed here; at S = 1 the caller's gradient stays
    # this rank's chunk: every replica's copy summed in rank order in reduce_dtype, divided, rounded once
    mine = _exchanged_sum(send, replicate_group, reduce_dtype, out_dtype, divisor=count)
    del send
    out = torch.empty(chunk * replicas, dtype=out_dtype, device=mine.device)
    all_gather_single(out, mine, group=replicate_group)
    return out[:n]


def sum_in_rank_order(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts: (W, shard). Row 0 + row 1 + ... in `dtype`, one row at a time (no tree, no reordering)."""
    return in_rank_order(parts, dtype, dtype)


BLOCK = 1 << 15  # elements summed at a time on the CPU: a 256 KiB float64 accumulator stays in cache


def in_rank_order(
    parts: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype, divisor: int | None = None
) -> torch.Tensor:
    """parts: (W, n). Per element: row 0 + row 1 + ... + row W-1 summed in `dtype` in that order,
    divided by `divisor` in `dtype` (if given), rounded once to `out_dtype`. A new tensor.

    On the CPU it runs BLOCK elements at a time: the wide accumulator stays in cache and is never
    the size of the shard (a whole-row float64 sum of fp32 rows is 3 to 4 passes over memory twice
    the size of the gradient). Every element goes through the same operations in the same order
    either way, so the bits do not depend on the block size."""
    n = parts.shape[1]
    out = torch.empty(n, dtype=out_dtype, device=parts.device)
    block = BLOCK if parts.device.type == "cpu" else max(n, 1)
    acc = None if out_dtype == dtype else torch.empty(min(block, n), dtype=dtype, device=parts.device)
    for start in range(0, n, block):
        end = min(start + block, n)
        a = out[start:end] if acc is None else acc[: end - start]
        a.copy_(parts[0, start:end])
        for j in range(1, parts.shape[0]):
            a.add_(parts[j, start:end])
        if divisor is not None:
            a.div_(divisor)
        if acc is not None:
            out[start:end].copy_(a)
    return out
