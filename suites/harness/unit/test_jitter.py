"""The jitter feature: where its delays go, that they are seeded and bounded, which runs a jittered run is
compared with, and the check that holds it bitwise to its calm twin (harness/train/jitter.py,
harness/checks/features.py jitter_invariant)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from harness.checks.features import jitter_invariant
from harness.core.features import check_feature
from harness.core.scenario import Scenario, build_matrix
from harness.tables.build import bitwise_difference
from harness.tables.schema import columns
from harness.train.jitter import MAX_DELAY_S, Jitter, delay_of


def test_jitter_composes_and_is_compared_with_the_same_run_without_it():
    assert check_feature("jitter+accum") == "accum+jitter"
    sc = Scenario("fsdp_impl", "mlp", 2, "split", "adamw", steps=3, feature="accum+jitter")
    calm = sc.calm()
    assert calm == sc.replace(feature="accum")
    assert sc.reference().feature == "accum" and sc.ws1().feature == "accum" and sc.ws1().world_size == 1
    assert calm in sc.dependencies() and calm.calm() is None
    assert sc.factor_twin().feature == "plain"
    # the plain model drops it too: delays change nothing in one process
    assert Scenario("reference", "mlp", 1, "replicated", "adamw", feature="jitter").reference().feature == "plain"
    ids = {
        s.id
        for s in build_matrix(["fsdp_impl"], ["mlp"], [2], ["replicated"], ["adamw"], steps=3, features=("jitter",))
    }
    assert {
        "fsdp_impl-mlp-ws2-replicated-adamw-jitter",
        "fsdp_impl-mlp-ws2-replicated-adamw",
        "fsdp_impl-mlp-ws1-replicated-adamw",
    } <= ids
    assert "fsdp_impl-mlp-ws1-replicated-adamw-jitter" not in ids


def test_delays_are_seeded_bounded_and_apart_between_ranks():
    draws = [delay_of(0, r, 1, i) for r in (0, 1) for i in range(200)]
    assert all(0.0 <= d <= MAX_DELAY_S for d in draws)
    assert draws == [delay_of(0, r, 1, i) for r in (0, 1) for i in range(200)]  # every run alike
    assert draws[:200] != draws[200:] and delay_of(1, 0, 1, 0) != delay_of(0, 0, 1, 0)
    assert max(draws) > 0.8 * MAX_DELAY_S and min(draws) < 0.2 * MAX_DELAY_S  # spread over the bound


@pytest.fixture
def world1(tmp_path):
    """A gloo world of one rank in this process, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_a_jitter_delays_collectives_waits_and_the_points_it_is_told(monkeypatch, world1):
    """Outside any implementation: an asynchronous all-reduce reaches the dispatcher (a 'collective'
    delay), its Work.wait is wrapped while the jitter is active (a 'wait' delay) and restored after; the
    forward mark and the optimizer point are the harness's."""
    slept = []
    monkeypatch.setattr("harness.train.jitter.time.sleep", slept.append)
    wait = dist.Work.wait
    t = torch.ones(3)
    with Jitter(seed=0, rank=0, step=1) as j:
        dist.all_reduce(t, group=world1, async_op=True).wait()
        j.marking(lambda phase, value=None: value)("after_forward", t)
        j.marking(lambda phase, value=None: value)("forward", t)  # another phase: no delay
        j.pause("optimizer")
    assert dist.Work.wait is wait
    assert dict(j.counts) == {"collective": 1, "wait": 1, "forward": 1, "optimizer": 1}
    assert slept == [delay_of(0, 0, 1, i) for i in range(4)] and j.slept == pytest.approx(sum(slept))
    dist.all_reduce(t, group=world1, async_op=True).wait()  # nothing after it exits
    assert j.delays == 4


def test_bitwise_difference_names_the_first_element_and_tells_signed_zeros_apart():
    a = torch.zeros(2, 3)
    assert bitwise_difference(a, a.clone()) == ""
    b = a.clone()
    b[1, 2] = -0.0  # equal as numbers (torch.equal), not bit for bit
    assert torch.equal(a, b) and bitwise_difference(a, b).startswith("(1, 2): 0.0 vs -0.0; 1 of 6")
    assert "missing" in bitwise_difference(a, None) and "shape" in bitwise_difference(a, torch.zeros(6))
    nan = torch.full((2,), float("nan"))
    assert bitwise_difference(nan, nan.clone()).startswith("(0,): nan vs nan")  # equal bits, nothing proven


def _tables(losses, calm_losses, calm_step=math.nan, delays=5):
    sc = Scenario("fsdp_impl", "mlp", 2, "replicated", "adamw", steps=3, feature="jitter")
    calm = sc.calm()
    ids = dict(
        impl="fsdp_impl",
        model="mlp",
        world_size=2,
        data_mode="replicated",
        optimizer="adamw",
        seed=0,
        status="ok",
        steps=3,
    )
    scen = pd.DataFrame(
        [
            {
                **ids,
                "scenario": sc.id,
                "feature": "jitter",
                "calm_step": calm_step,
                "calm_param": "layers.1.weight" if calm_step == calm_step else "",
                "calm_element": "(0, 1): 0.5 vs 0.25; 1 of 8 elements differ",
                "calm_compared": 4,
            },
            {**ids, "scenario": calm.id, "feature": "plain"},
        ],
        columns=columns("scenarios"),
    )
    steps = pd.DataFrame(
        [
            {"scenario": s, "step": k + 1, "loss": loss, "jitter_delays": d, "jitter_s": 0.01 * d}
            for s, ls, d in ((sc.id, losses, delays), (calm.id, calm_losses, 0))
            for k, loss in enumerate(ls)
        ],
        columns=columns("steps"),
    )
    return {"scenarios": scen, "steps": steps}, sc, calm


def test_jitter_invariant_passes_only_when_bitwise_equal_and_perturbed():
    tables, sc, calm = _tables([0.5, 0.4, 0.3], [0.5, 0.4, 0.3])
    [v] = jitter_invariant(tables)
    assert v.status == "pass" and calm.id in v.message and "15 delays" in v.message
    # a parameter element that differs: step, parameter and element named
    [v] = jitter_invariant(_tables([0.5, 0.4, 0.3], [0.5, 0.4, 0.3], calm_step=2)[0])
    assert v.status == "fail" and (v.step, v.param) == (2, "layers.1.weight") and "(0, 1): 0.5 vs 0.25" in v.message
    # a loss one ulp off at step 3
    [v] = jitter_invariant(_tables([0.5, 0.4, 0.3], [0.5, 0.4, math.nextafter(0.3, 1)])[0])
    assert v.status == "fail" and (v.step, v.param) == (3, "loss")
    # a NaN loss in both runs proves nothing
    [v] = jitter_invariant(_tables([0.5, math.nan, math.nan], [0.5, math.nan, math.nan])[0])
    assert v.status == "fail" and (v.step, v.param) == (2, "loss")
    # the earlier of the two is named
    [v] = jitter_invariant(_tables([0.5, 0.41, 0.3], [0.5, 0.4, 0.3], calm_step=3)[0])
    assert (v.step, v.param) == (2, "loss")
    # nothing was perturbed: a measurement of nothing
    [v] = jitter_invariant(_tables([0.5, 0.4, 0.3], [0.5, 0.4, 0.3], delays=0)[0])
    assert v.status == "fail" and "no delay was injected" in v.message
    # no calm twin in the run
    alone = {k: t[t.scenario != calm.id] for k, t in tables.items()}
    [v] = jitter_invariant(alone)
    assert v.status == "fail" and "is not in this run" in v.message
