"""Correct implementations on ordinary models a user brings (suites/harness/unit/ordinary_models.py): no false
alarm from a bound that depended on the implementation measured (peak memory), or that forgot the padding of an
uneven parameter under hybrid sharding (traffic)."""

from __future__ import annotations

import pytest

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

CONV = "suites.harness.unit.ordinary_models:conv_net"


@pytest.fixture(scope="module")
def conv_run(kept_worlds):
    # accumulation at one rank: both implementations hold the same bytes, once held to bounds of their own making;
    # hybrid sharding at 4 ranks: the 7-row head is padded to 8 rows in both reductions (the shard group's and the
    # replicas')
    scenarios = build_matrix(
        ["fsdp_impl", "torch_fsdp2"],
        [CONV],
        [1, 4],
        ["replicated", "split"],
        ["adamw"],
        steps=3,
        features=("accum", "hsdp"),
    )
    return run_matrix(scenarios, pool=kept_worlds)


@pytest.mark.parametrize("check", ["peak_memory_bound", "comm_volume", "memory_sharding"])
def test_a_small_conv_net_with_an_uneven_head_raises_no_false_alarm(conv_run, check):
    held = [v for v in conv_run.verdicts if v.check == check and not v.scenario.startswith("reference")]
    assert held and all(v.status == PASS for v in held), [str(v) for v in held if v.status == FAIL]


def test_the_peak_bound_is_the_steps_not_the_implementations(conv_run):
    """Both implementations' peak bounds in a cell are made of the same parts: the ideal, two units gathered and the
    plain model's own activations."""
    bounds = {}
    for v in conv_run.verdicts:
        if v.check == "peak_memory_bound" and not v.scenario.startswith("reference"):
            impl, cell = v.scenario.split("-", 1)
            bounds.setdefault(cell, {})[impl] = v.bound
    assert bounds and all(len(set(b.values())) == 1 for b in bounds.values() if len(b) == 2), bounds
