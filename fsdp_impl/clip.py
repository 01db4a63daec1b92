"""Gradient-norm clipping over the whole sharded model: the global norm, not a rank's own.

A norm of each rank's own shard would be off by about sqrt(W) for norm 2, and differ on every rank.
``clip_grad_norm_(model, ...)`` here reduces each rank's part over the unit's process group, one
all-reduce for the whole model, and scales every shard's gradient by the same coefficient.
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` gives the global norm too: the gradients
are DTensors, Shard(d) over the shard group's mesh with each rank's rows (no padding) as the local
tensor, so torch's norms are partial per rank and DTensor reduces them over the mesh, in fp32: equal
to this one within float32 rounding at W > 1, bitwise at W = 1 (suites/fsdp_impl/test_fsdp2_api.py).

At world size 1 it computes exactly what torch's function computes on the unsharded parameters
(per-parameter norms, then the norm of those), so one rank is bitwise the plain model. At W > 1 a
parameter split over ranks contributes partial sums of squares (in float64, summed over ranks by
the all-reduce): the norm is right to float32 rounding, but it is not bitwise the W = 1 value,
since the sum runs in another order. The infinity norm is a maximum and is exact at any W.

Under HSDP the reduction runs over the shard group only: the S ranks of a shard
group hold the whole model between them, and the replicas hold the same shards (their gradients
were all-reduced, bitwise equal), so each replica computes the same global norm on its own;
summing over all R x S ranks would count every element R times (norm off by sqrt(R)).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import device_for
from .state import sharded_params, units


def all_reduce_norm(value: torch.Tensor, op, group) -> None:
    """The one collective of clipping (a name of its own so that tests can replace it)."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)


def _local_parts(module: nn.Module, norm_type: float) -> tuple[list[torch.Tensor], list[torch.Tensor], object]:
    """(what this rank counts in the norm, in the order ``module.parameters()`` lists them; every
    gradient tensor to scale; the shard group). A sharded parameter counts its rows (its DTensor
    gradient's local tensor, maybe empty); a parameter outside every unit is whole on every rank,
    so for norm 2 rank 0 alone counts it. The sharded parameters sit under the original names, so at
    one rank the norm of the per-parameter norms is summed exactly as torch sums it on the plain model."""
    group = next((state.params.group for _, state in units(module)), None)
    if group is None:
        raise ValueError("clip_grad_norm_: no fully_shard unit under this module")
    counts_plain = norm_type == math.inf or dist.get_rank(group) == 0
    own, grads = [], []
    for q in module.parameters():
        if q.grad is None:
            continue
        if getattr(q, "_fsdp_managed", False):
            local = q.grad._local_tensor if isinstance(q.grad, DTensor) else q.grad
            own.append(local)
            grads.append(local)
        else:
            grads.append(q.grad)
            if counts_plain:
                own.append(q.grad)
    return own, grads, group


def row_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of whole gradients computed the batch-invariant way: each gradient's sums of squares
    per dim-0 row in float64, every gradient's rows concatenated in order, summed as one vector. A rank holding a
    row range of each computes those rows alike, so the sum is the same at every world size (0-dim: one row)."""
    rows = [_row_sums(g) for g in grads]
    return torch.cat(rows).sum() if rows else torch.zeros((), dtype=torch.float64)


def _row_sums(g: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """float64 sums of squares of `g` per dim-0 row (`rows` of them: a shard may hold none; 0-dim: one row)."""
    n = rows if rows is not None else g.shape[0] if g.dim() else 1
    return g.double().pow(2).reshape(n, g.numel() // n if n else 0).sum(1)


def _invariant_sq(module: nn.Module, group) -> torch.Tensor:
    """``row_norm_sq`` of every gradient of `module` in ``module.parameters()`` order, from this rank's rows: each
    sharded gradient's row sums, padded to its chunk, one all-gather of all of them, the full vectors cut out."""
    by_id = {id(p.sharded): p for _, p in sharded_params(module)}
    world, device = dist.get_world_size(group), device_for(group)
    pieces, layout = [], []  # layout: ("sharded", ShardedParam, offset) or ("whole", row sums)
    offset = 0
    for q in module.parameters():
        if q.grad is None:
            continue
        p = by_id.get(id(q))
        if p is None:
            layout.append(("whole", _row_sums(q.grad)))
            continue
        if p.dim != 0:
            raise ValueError(
                f"clip_grad_norm_(batch_invariant=True): '{p.fqn}' is sharded on dim {p.dim}; the "
                f"invariant norm reads dim-0 rows"
            )
        local = q.grad._local_tensor if isinstance(q.grad, DTensor) else q.grad
        sums = _row_sums(local, p.end - p.start)
        padded = torch.zeros(p.chunk, dtype=torch.float64, device=device)
        padded[: sums.numel()] = sums.to(device)
        pieces.append(padded)
        layout.append(("sharded", p, offset))
        offset += p.chunk
    gathered = None
    if pieces:
        send = torch.cat(pieces)
        gathered = torch.empty(world * send.numel(), dtype=send.dtype, device=device)
        if world == 1:
            gathered.copy_(send)
        else:
            from .collectives import all_gather_single

            all_gather_single(gathered, send, group=group)
        gathered = gathered.view(world, -1)
    rows = []
    for kind, a, *rest in layout:
        if kind == "whole":
            rows.append(a.to(device))
        else:
            rows.append(gathered[:, rest[0] : rest[0] + a.chunk].reshape(-1)[: a.rows])
    return torch.cat(rows).sum() if rows else torch.zeros((), dtype=torch.float64, device=device)


def clip_grad_norm_(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, *, batch_invariant: bool = False
) -> torch.Tensor:
    """Scale every gradient of `module` (sharded by fully_shard) so that the global norm is at most
    `max_norm`, as ``torch.nn.utils.clip_grad_norm_`` does for an unsharded model (same coefficient
    ``max_norm / (norm + 1e-6)``, clamped at 1). Returns the global norm before clipping (float32,
    the same on every rank). Collective: every rank of the units' group calls it (under HSDP every
    rank of every replica: each reduces over its own shard group).

    `batch_invariant` (norm 2; fsdp_impl.invariant): the norm computed the same way at every world size
    (``row_norm_sq``: float64 sums of squares per dim-0 row, gathered, summed in row order), so clipping keeps a
    batch-invariant step's bits independent of W; it is not torch's per-parameter formula, so at one rank it is
    not bitwise ``torch.nn.utils.clip_grad_norm_``. The infinity norm is invariant as it is (a maximum)."""
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type} is not supported (2 or inf)")
    own, grads, group = _local_parts(module, norm_type)
    world = dist.get_world_size(group)
    dtype = next((g.dtype for g in grads), torch.float32)
    device = next((g.device for g in grads), torch.device("cpu"))
    if batch_invariant and norm_type == 2.0:
        total = _invariant_sq(module, group).sqrt().to(dtype).to(device)
    elif world == 1:  # torch's computation on the whole parameters: per-parameter norms, then their norm
        norms = torch._foreach_norm(own, norm_type) if own else []
        total = (
            torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
            if norms
            else torch.zeros((), dtype=dtype, device=device)
        )
    elif norm_type == math.inf:  # the collective runs where the group's backend takes tensors (offloaded
        local = max((float(t.abs().max()) for t in own if t.numel()), default=0.0)  # gradients: on the host)
        total = torch.tensor(local, dtype=dtype, device=device_for(group))
        all_reduce_norm(total, dist.ReduceOp.MAX, group)
        total = total.to(device)
    else:
        sq = sum(
            (t.double().pow(2).sum().to(device_for(group)) for t in own),
            torch.zeros((), dtype=torch.float64, device=device_for(group)),
        )
        all_reduce_norm(sq, dist.ReduceOp.SUM, group)
        total = sq.sqrt().to(dtype).to(device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        with torch.no_grad():
            torch._foreach_mul_(grads, coef)
    return total
