"""Batch-invariant training: the same bits at every world size, in both data modes.

``invariant_forward_backward(module, loss_fn, inputs, targets, micro_batches=L)`` runs one step's forward and
backward on this rank's contiguous slice of the global batch so that the gradients every rank ends with (and
the loss it returns) do not depend on the number of ranks W:

    cut      the global batch is L equal micro-batches (L a power of two, W dividing it); rank r takes its
             slice as L / W of them, micro-batches r x L / W ... (r + 1) x L / W - 1 of the global batch, so
             every micro-batch has the same shape at every W and every kernel computes the same values
    scale    each micro-batch's loss is divided by L (a power of two: exact), so the sum of the L micro-batch
             gradients is the gradient of the global batch's mean loss; there is no division by W
    sum      the L gradients are added in ONE fixed binary tree over the global micro-batch index (pairs
             (0, 1), (2, 3), ..., then pairs of those, ...): the levels below a rank's own micro-batches on
             the rank (``TreeSum``, as each micro-batch's backward ends), the levels above them across ranks in
             the gradient reduction (collectives.reduce_scatter_tree: rank r's partial sums paired with rank
             r + 1's, ...). Floating-point addition is commutative, so a + b == b + a; only the grouping could
             differ, and the tree fixes it
    loss     the micro-batch losses are summed in the same tree (across ranks with an all-gather of the W
             partial sums): every rank returns the same bits, at every W

After it, the optimizer steps each rank's shard; every optimizer the harness knows is element-wise, and an
element's update does not depend on which rank holds it, so parameters and optimizer state stay invariant.

The sums run in the gradient's dtype (the policy's ``reduce_dtype`` under mixed precision: bf16 gradients are
cast to it as each micro-batch ends). What it costs: L / W forward/backward passes of global / L samples each
instead of one of global / W samples, and the unsharded gradients held between micro-batches (as with
gradient accumulation) plus up to log2(L / W) partial sums of them (the tree's pending left operands).

The other features (tested in suites/fsdp_impl/test_invariant.py at W = 1, 2, 4, 8 against the plain model doing
the same):
    accumulation / no_sync  are more micro-batches: raise L (the tree spans a step's every micro-batch)
    bf16                    each micro-batch's bf16 gradient is cast to the policy's fp32 reduce dtype as it ends;
                            the tree runs in fp32: invariant
    ac                      the recomputation computes what the forward computed: invariant
    ckpt                    parameters and optimizer state are element-wise and the checkpoint moves them whole: a
                            run saved at W and resumed at W' is bitwise the uninterrupted run
    clip_inf                a maximum is exact: invariant as it is
    clip (L2)               ``clip_grad_norm_(..., batch_invariant=True)``: float64 sums of squares per dim-0 row,
                            gathered, summed in row order, the same at every W. The default norm (each rank's
                            float64 partial sum, all-reduced) differs between world sizes in float64's last bits,
                            which the rounding to float32 almost always removes: almost, not always
    hsdp                    refused: the tree's upper levels would run across the replicate group (not built)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_single
from .mesh import device_for
from .state import units
from .tree import TreeSum, tree_sum_rows


def invariant_forward_backward(
    module: nn.Module,
    loss_fn: Callable,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batches: int,
    replicated: bool = False,
    keep_gathered: bool = True,
) -> torch.Tensor:
    """Forward and backward of one step on this rank's slice (`inputs`, `targets`: the rank's contiguous
    1 / W of the global batch) as `micro_batches` = L global micro-batches, gradients summed in the fixed tree
    (see the module docstring); returns the global batch's mean loss (detached, the same bits on every rank and
    at every W). `module`: the root passed to ``fully_shard``; `loss_fn(output, targets)` must be a mean over
    the micro-batch. Collective. Leaves the sharded gradients for the optimizer, as a plain backward does.

    `replicated`: every rank holds the WHOLE global batch (data-parallel replicas of one batch): each runs all L
    micro-batches and its own whole tree, and the reduction averages the W identical sums (in the default
    wider dtype: exact), so the result is one rank's, bit for bit, at every W.

    `keep_gathered` (default True): the units stay gathered from the first micro-batch's forward to the last one's
    backward, so each is all-gathered once a step, not twice per micro-batch; the price is the whole model's
    parameters held unsharded through the step (False: each micro-batch gathers and reshards as a plain step
    does). Either way the numbers are the same."""
    states = [state for _, state in units(module)]
    if not states:
        raise ValueError("invariant_forward_backward: no fully_shard unit under this module")
    group = states[0].params.group
    world = dist.get_world_size(group)
    if micro_batches < 1 or micro_batches & (micro_batches - 1) or micro_batches % world:
        raise ValueError(
            f"invariant_forward_backward: micro_batches must be a power of two that the {world} "
            f"ranks divide, not {micro_batches}"
        )
    if any(s.params.replicate_group is not None for s in states):
        raise ValueError("invariant_forward_backward: hybrid sharding is not supported (see fsdp_impl.invariant)")
    per_rank = micro_batches if replicated else micro_batches // world
    if inputs.shape[0] % per_rank:
        raise ValueError(
            f"invariant_forward_backward: a rank's {inputs.shape[0]} samples do not split into its "
            f"{per_rank} micro-batches"
        )
    size = inputs.shape[0] // per_rank
    losses = TreeSum()
    resharded = {s: s.reshard_after_forward for s in states}
    for s in states:
        s.params.begin_tree(across_ranks=not replicated)
        s.reshard_after_forward = False if keep_gathered else s.reshard_after_forward  # (None: FSDP2's default)
    try:
        for i in range(per_rank):
            last = i == per_rank - 1
            for s in states:
                s.params.sync_grads = last
                s.params.keep_gathered = keep_gathered and not last
            sl = slice(i * size, (i + 1) * size)
            loss = loss_fn(module(inputs[sl]), targets[sl]) / micro_batches
            loss.backward()
            losses.push(loss.detach().clone())
    finally:
        for s in states:
            s.params.sync_grads, s.params.keep_gathered = True, False
            s.reshard_after_forward = resharded[s]
            s.params.end_tree()
            s.params.reshard()  # a step that raised may leave a unit gathered
    mine = losses.result().reshape(1)
    if replicated or world == 1:
        return mine[0]
    every = torch.empty(world, dtype=mine.dtype, device=device_for(group))
    all_gather_single(every, mine.to(every.device), group=group)
    return tree_sum_rows(every).to(mine.device)
