"""The memory planner (`python -m harness plan`, harness/plan/): it answers any world size it accepts in the time
a small one takes, with the same plan it would make cutting every chunk, and an implementation it cannot plan is
one line, not a traceback."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness import limits
from harness.plan import memory
from harness.plan.table import PlanError, plan_table

ROWS = 3000  # the widest parameter's dim 0: the largest world size the planner accepts for this model


class Wide(nn.Module):
    """A model written for these tests: one parameter of many short rows (an embedding) among narrow ones, so that
    at its largest world size every other parameter has far fewer rows than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(ROWS, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(6)])
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).mean(1)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def _batch(n: int, step: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, ROWS, (n, 5), generator=g), torch.randint(0, 3, (n,), generator=g)


def spec():
    from harness.train.models import ModelSpec

    return ModelSpec("wide", Wide, _batch, torch.nn.functional.cross_entropy, lambda m: list(m.blocks))


WIDE = "suites.harness.unit.test_plan:spec"


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(world_size: int) -> int:
    with _OpCount() as count:
        plan_table(WIDE, ["torch_fsdp2"], [world_size])
    return count.ops


def test_the_largest_accepted_world_size_costs_the_planner_what_a_small_one_does():
    """FSDP2 cuts every parameter into W chunks; the planner's work must not grow with W (it plans one rank)."""
    size = limits.model_size(WIDE)
    assert size.largest_rows == ROWS
    limits.check_plan_world_sizes(WIDE, [ROWS], size)  # accepted without --allow-large
    assert _ops(ROWS) == _ops(8)


@pytest.mark.parametrize("impl", ["torch_fsdp2", "fsdp_impl"])
def test_the_plan_is_the_one_every_chunk_cut_gives(monkeypatch, impl):
    """World sizes that divide the rows, that do not, and that leave most ranks without a row of most parameters."""
    sizes = [1, 2, 7, 64, ROWS]
    fast = plan_table(WIDE, [impl], sizes)
    monkeypatch.setattr(memory, "_chunks_on_demand", contextlib.nullcontext)
    every_chunk = plan_table(WIDE, [impl], sizes)
    columns = ["world_size", "params", "grads", "optimizer_state", "state_total", "ideal_state_total"]
    assert fast[columns].equals(every_chunk[columns])


def test_an_implementation_the_planner_cannot_plan_is_one_line():
    with pytest.raises(PlanError) as e:
        plan_table(WIDE, ["ddp"], [2])
    assert "--impl ddp: the planner cannot plan it" in str(e.value) and "\n" not in str(e.value)
    assert not isinstance(e.value, argparse.ArgumentTypeError)  # the CLI makes it a usage error
