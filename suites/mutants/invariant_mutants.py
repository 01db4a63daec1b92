"""Faults of a batch-invariant step (fsdp_impl.invariant) that leave the default mode untouched: only the
batch-invariant tier (harness/invariant, ``--invariant``) runs that step, so nothing else can catch them.

- ``tree_sequential``: each rank adds its micro-batches' gradients one after the other, ((g0 + g1) + g2) + g3,
  not in the tree, (g0 + g1) + (g2 + g3): the same as the tree while a rank holds at most 2 micro-batches
- ``ranks_in_rank_order``: the tree's levels across ranks summed in rank order, ((r0 + r1) + r2) + r3: the same
  as the tree at W <= 2
- ``loss_per_rank``: each micro-batch's loss divided by the rank's L / W micro-batches, not by L: the gradient W
  times too large, the same at W = 1
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from suites.mutants.injection import MutantAdapter, param_groups_of, rebind


class _Sequential:
    """TreeSum's interface, adding in index order."""

    def __init__(self) -> None:
        self.total, self.count = None, 0

    def push(self, t) -> None:
        self.count += 1
        self.total = t if self.total is None else self.total if t is None else self.total.add_(t)

    def __len__(self) -> int:
        return self.count

    def result(self):
        total, self.total, self.count = self.total, None, 0
        return total


class TreeSequential(MutantAdapter):
    name = "mutant:tree_sequential"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            begin = g.begin_tree

            def sequential(across_ranks=True, g=g, begin=begin):
                begin(across_ranks)
                g._trees = {p: _Sequential() for p in g._trees}

            g.begin_tree = sequential


def _ranks_in_order(full_grad, group, dtype):
    world = dist.get_world_size(group)
    if world == 1:
        return full_grad.to(dtype, copy=True)
    recv = torch.empty_like(full_grad)
    dist.all_to_all_single(recv, full_grad.contiguous(), group=group)
    rows = recv.view(world, -1).to(dtype)
    out = rows[0].clone()
    for r in range(1, world):
        out = out + rows[r]
    return out


class RanksInRankOrder(MutantAdapter):
    name = "mutant:ranks_in_rank_order"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            rebind(g, "reduce_grads", reduce_scatter_tree=_ranks_in_order)


class LossPerRank(MutantAdapter):
    name = "mutant:loss_per_rank"

    def invariant_forward_backward(self, wrapped, loss_fn, inputs, targets, *, micro_batches, replicated):
        world = 1 if replicated else dist.get_world_size()

        def per_rank(out, y):
            return loss_fn(out, y) * world  # / L x W = / (L / W)

        return super().invariant_forward_backward(
            wrapped, per_rank, inputs, targets, micro_batches=micro_batches, replicated=replicated
        )


tree_sequential, ranks_in_rank_order, loss_per_rank = TreeSequential, RanksInRankOrder, LossPerRank


class ClaimsWithoutStep:
    """An adapter that declares batch_invariant and has no invariant step: the tier cannot hold the claim."""

    name, batch_invariant = "claims_without_step", True

    def wrap(self, model, units, *, group, device):
        return model

    def full_params(self, wrapped):
        return dict(wrapped.named_parameters())
