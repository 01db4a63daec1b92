"""Faults of the optimizer step: an optimizer run on each rank's shard as if the shard were the matrix
(DeepSpeed #7807, as ZeRO code steps its flat partitions). An element-wise optimizer (SGD, AdamW) steps a
shard exactly as it steps the matrix, so no cell of theirs can show it; a per-matrix optimizer (one whose
update depends on the whole matrix: a norm, an orthogonalisation) does, in the cells of the zoo's
normalised SGD (--optimizers harness.train.optim:normalised_sgd), where each shard is divided by its
own norm.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from harness.optimizers import make_optimizer
from suites.mutants.injection import MutantAdapter


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardNormalised(MutantAdapter):
    """fsdp_impl whose optimizer is built over the rank's local shards (plain tensors, each a DTensor
    parameter's ``to_local``) instead of the DTensor parameters: before each step every shard is handed
    its parameter's local gradient (and the DTensor's own gradient is released, so the next backward starts
    from none, as after zero_grad). Under normalised SGD each shard is divided by its own norm, about
    1/sqrt(W) of the matrix's: the update is about sqrt(W) x too large at W > 1 (exact at W = 1, where the
    shard is the matrix). Under AdamW and SGD the numbers are those of fsdp_impl."""

    name = "mutant:shard_normalised"

    def make_optimizer(self, wrapped, *, name, lr):
        pairs = [(p, _local(p)) for p in wrapped.parameters()]
        optimizer = make_optimizer([shard for _, shard in pairs], name, lr)

        def hand_gradients(opt, args, kwargs):
            for p, shard in pairs:
                shard.grad = None if p.grad is None else _local(p.grad)
                p.grad = None

        optimizer.register_step_pre_hook(hand_gradients)
        return optimizer
