"""A small engine that drives its own step, as DeepSpeed's does, written for the tests of the engine hooks
(harness.adapters.base): a whole replica per rank; its `backward` divides each micro-batch's loss by its own
accumulation, and its `step`, called after every micro-batch, counts them and only at the accumulation boundary
averages the gradients over the ranks (one all-reduce each), clips them as the options ask, and steps. Nothing of
it happens unless the harness calls its hooks: a harness that ran `loss.backward()` and `optimizer.step()` itself
would train W unaveraged replicas.

Faulty engines beside it, modelled on reported DeepSpeed bugs: one that steps at every micro-batch (the accumulation
boundary ignored), one that divides the loss by the accumulation twice, one that declares the clipping and does
not clip."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from harness.adapters.base import PLAIN_WRAP, Adapter, cpu_fp32


@dataclass
class EngineState:
    group: object
    micro_batches: int
    clip: tuple[float, float] | None
    micro_steps: int = 0


class ReplicaEngine(Adapter):
    name = "replica_engine"
    sharded = False
    wrap_settings = frozenset({"accumulation", "clipping"})

    def wrap(self, model: nn.Module, units, *, group, device, options=PLAIN_WRAP) -> nn.Module:
        model.to(device)
        model._engine = EngineState(group, options.micro_batches, options.clip)
        return model

    def backward(self, wrapped: nn.Module, loss: torch.Tensor) -> None:
        (loss / wrapped._engine.micro_batches).backward()

    def boundary(self, state: EngineState) -> bool:
        return state.micro_steps % state.micro_batches == 0

    def step(self, wrapped: nn.Module, optimizer) -> None:
        state = wrapped._engine
        state.micro_steps += 1
        if not self.boundary(state):
            return
        world = dist.get_world_size(state.group)
        for p in wrapped.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=state.group)
                p.grad.div_(world)
        if state.clip is not None:
            norm_type, max_norm = state.clip
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm, norm_type)
        optimizer.step()

    def zero_grad(self, wrapped: nn.Module, optimizer) -> None:
        if self.boundary(wrapped._engine):
            optimizer.zero_grad(set_to_none=True)

    def full_params(self, wrapped: nn.Module) -> dict[str, torch.Tensor]:
        return {name: cpu_fp32(p) for name, p in wrapped.named_parameters()}


class StepsEveryMicroBatch(ReplicaEngine):
    """The accumulation boundary ignored: the optimizer steps after every micro-batch."""

    name = "engine_steps_every_micro_batch"

    def boundary(self, state: EngineState) -> bool:
        return True


class LossScaledTwice(ReplicaEngine):
    """The loss divided by the accumulation twice: each micro-batch's gradient 1/k^2 of what it should be."""

    name = "engine_loss_scaled_twice"

    def backward(self, wrapped: nn.Module, loss: torch.Tensor) -> None:
        k = wrapped._engine.micro_batches
        (loss / k / k).backward()


class ClipIgnored(ReplicaEngine):
    """Declares the clipping and never clips."""

    name = "engine_clip_ignored"

    def wrap(self, model: nn.Module, units, *, group, device, options=PLAIN_WRAP) -> nn.Module:
        wrapped = super().wrap(model, units, group=group, device=device, options=options)
        wrapped._engine.clip = None
        return wrapped


replica_engine, steps_every_micro_batch, loss_scaled_twice = ReplicaEngine, StepsEveryMicroBatch, LossScaledTwice
clip_ignored = ClipIgnored
