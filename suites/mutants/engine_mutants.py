"""Faults of an implementation that drives its own step (an engine: harness.adapters.base's hooks), modelled on bugs
reported against DeepSpeed's engine: each is the replica engine of suites/harness/end_to_end/engine_adapters.py
(its backward divides by its accumulation; its step averages the ranks' gradients at the accumulation boundary,
clips, and steps) with one fault.

- an accumulation boundary off by one micro-batch (DeepSpeed #1488, #5898: losses that differ from the full batch
  under gradient accumulation): the step comes after the first micro-batch of each step, the last one's gradient
  carried into the next;
- the loss divided by the accumulation twice (the engine's division and the loop's, accelerate #3877's class);
- clipping by the norm of one partition of the gradient (a ZeRO stage's rank-local norm where the global one is
  meant): each rank scales by its own partition's norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from suites.harness.end_to_end.engine_adapters import EngineState, ReplicaEngine


class EngineBoundaryOffByOne(ReplicaEngine):
    name = "mutant:engine_boundary_off_by_one"

    def boundary(self, state: EngineState) -> bool:
        return state.micro_steps % state.micro_batches == 1 % state.micro_batches


class EngineLossScaledTwice(ReplicaEngine):
    name = "mutant:engine_loss_scaled_twice"

    def backward(self, wrapped: nn.Module, loss: torch.Tensor) -> None:
        k = wrapped._engine.micro_batches
        (loss / k / k).backward()


class EngineClipByPartition(ReplicaEngine):
    name = "mutant:engine_clip_by_partition"

    def step(self, wrapped: nn.Module, optimizer) -> None:
        state = wrapped._engine
        state.micro_steps += 1
        if not self.boundary(state):
            return
        world = dist.get_world_size(state.group)
        grads = [p.grad for p in wrapped.parameters() if p.grad is not None]
        for g in grads:
            dist.all_reduce(g, group=state.group)
            g.div_(world)
        if state.clip is not None:
            norm_type, max_norm = state.clip
            flat = torch.cat([g.reshape(-1) for g in grads])
            mine = flat.tensor_split(world)[dist.get_rank(state.group)]  # this rank's partition alone
            coef = torch.clamp(max_norm / (torch.linalg.vector_norm(mine, norm_type) + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)
        optimizer.step()
