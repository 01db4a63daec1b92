"""A complete user adapter: plain data parallelism written by hand (no sharding).

Run it under the harness with ``--impl suites.harness.unit.example_adapter:adapter``. It is the smallest
useful template: replace ``wrap`` with your sharding and ``full_params`` with your gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.adapters.base import Adapter


class AllReduceAdapter(Adapter):
    """Every rank keeps the whole model; after backward, gradients are averaged over the group."""

    name = "example_allreduce"
    sharded = False  # a full replica per rank: memory checks expect no per-rank reduction

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        self.group = group
        model.to(device)
        for p in model.parameters():  # start from rank 0's weights, as DDP does
            dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)
        return model

    def after_backward(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        world = dist.get_world_size(self.group)
        for p in wrapped.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
                p.grad.div_(world)  # each rank's loss is its local mean: average, not sum

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        return {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in wrapped.named_parameters()}


adapter = AllReduceAdapter()
