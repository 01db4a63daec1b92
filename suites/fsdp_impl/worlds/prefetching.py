"""fsdp_worlds tasks on prefetching: when each unit's all-gather is issued against when the unit
computes, how many units are gathered at once, and what a forward that leaves the recorded path
leaves behind.

The events come from outside fsdp_impl's hooks: the all-gathers from a spy on the collective
group.py calls, the computations from forward pre-hooks and output-gradient hooks registered after
fully_shard (so they run after fsdp_impl's own hooks, when the unit's parameters must be ready).
"""

from __future__ import annotations

import torch
from torch import nn

import fsdp_impl.group as fsdp_group
from fsdp_impl.param import ShardState
from fsdp_impl.state import units
from harness.optimizers import make_optimizer
from suites.fsdp_impl.worlds.common import build, local_batch, patched, shard_model


def _names(model: nn.Module) -> dict[int, str]:
    """id(ParamGroup) -> unit name ('<root>' for the model itself)."""
    return {id(state.params): prefix or "<root>" for prefix, state in units(model)}


def _gathered(model: nn.Module) -> list[str]:
    """Units whose parameters are gathered or being gathered, the root left out."""
    return sorted(
        prefix
        for prefix, state in units(model)
        if prefix and (state.params.state is ShardState.UNSHARDED or state.params.gathering)
    )


def _record(model: nn.Module, events: list) -> None:
    """Log ('compute', unit, gathered units) as each unit's forward starts and ('backward', unit,
    gathered units) as its backward starts (after fsdp_impl's hooks have run)."""
    for prefix, state in units(model):
        name = prefix or "<root>"

        def grad_hook(grad, name=name):
            events.append(("backward", name, _gathered(model)))
            return grad

        def pre(module, args, name=name):
            events.append(("compute", name, _gathered(model)))

        def post(module, args, out, grad_hook=grad_hook):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(grad_hook)

        state.module.register_forward_pre_hook(pre)
        state.module.register_forward_hook(post)


def events(ctx, p: dict) -> dict:
    """Train `steps` steps of the sharded model; per step, the ordered events: ('gather', unit,
    asynchronous unshard?) at every all-gather issued by a unit's unshard, and the compute / backward
    events of ``_record``. Also the unit states after every step."""
    model, spec = build(p, ctx)
    names = _names(model)
    opt = make_optimizer(model.parameters(), "adamw", 0.01)
    log: list = []
    issued = fsdp_group.all_gather_flat

    def spy(out, shard, group, async_op=False):
        log.append(("gather", *current))
        return issued(out, shard, group, async_op=async_op)

    current = [None, None]  # the unit whose unshard runs, and whether that unshard is asynchronous
    unshard = fsdp_group.ParamGroup.unshard

    def tracked_unshard(self, async_op=False):
        current[:] = names.get(id(self)), async_op
        return unshard(self, async_op=async_op)

    _record(model, log)
    steps, after = [], []
    with patched(fsdp_group, "all_gather_flat", spy), patched(fsdp_group.ParamGroup, "unshard", tracked_unshard):
        for step in range(1, p.get("steps", 2) + 1):
            log.clear()
            x, y = local_batch(spec, p, step, ctx)
            spec.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            steps.append(list(log))
            after.append(_gathered(model))
    return {"steps": steps, "after": after}


class Chain(nn.Module):
    """Three linear blocks; forward(x, n) runs the first n: a forward whose path can change."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.n = 3

    def forward(self, x):
        for block in self.blocks[: self.n]:
            x = torch.tanh(block(x))
        return x


def changed_path(ctx, p: dict) -> dict:
    """A forward through all three blocks, then one through two: the prefetch of block 2, issued
    from the recorded order, is never used. Returns the gathered units after each forward and
    backward."""
    torch.manual_seed(0)
    model = Chain()
    shard_model(model, list(model.blocks), ctx.group)
    out = {}
    for n in (3, 2):
        model.n = n
        y = model(torch.randn(4, 8))
        out[f"after_forward_{n}"] = _gathered(model)
        y.square().mean().backward()
        out[f"after_backward_{n}"] = _gathered(model)
    return out
