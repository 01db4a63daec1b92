"""A known deviation's cause, and why a bound is not bitwise, say what the scenario's own optimizer does with a
last-bit difference (harness/core/policy.py `carried`): an SGD cell's verdict never says "AdamW amplifies that"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.checks.common import judge
from harness.core.policy import KNOWN_DEVIATIONS, Bounds
from harness.core.verdict import KNOWN

OPTIMIZERS = ("adamw", "sgd", "mypkg.optim:lion")
NAMES = {"adamw": "AdamW", "sgd": "SGD"}


def _row(optimizer: str, impl: str = "torch_fsdp2", world_size: int = 8):
    sid = f"{impl}-mlp-ws{world_size}-replicated-{optimizer.replace(':', '.')}"
    return SimpleNamespace(
        scenario=sid,
        impl=impl,
        model="mlp",
        world_size=world_size,
        data_mode="replicated",
        optimizer=optimizer,
        seed=0,
        status="ok",
        feature="plain",
        resume_from=0,
        backend="gloo",
    )


def _others(optimizer: str) -> list[str]:
    return [name for key, name in NAMES.items() if key != optimizer]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_known_deviations_cause_names_the_scenarios_own_optimizer(optimizer):
    v = judge("cross_ws_replicated", _row(optimizer), False, 1e-7, 3e-8, "max |param diff| over the bound.")
    assert v.status == KNOWN
    for other in _others(optimizer):
        assert f"{other} amplifies" not in v.message and f"{other} carries" not in v.message, v.message
    assert "{carried}" not in v.message


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_l2_clipping_bound_says_what_the_optimizer_does(optimizer):
    _, why = Bounds().replicated_bound("clip", optimizer, 1e-2, 10)
    assert NAMES[optimizer] in why and not any(other in why for other in _others(optimizer)), why


@pytest.mark.parametrize("dev", KNOWN_DEVIATIONS, ids=lambda d: f"{d.impl}-{d.check}-{d.feature or 'any'}")
def test_every_cause_said_for_any_optimizer_is_filled_in(dev):
    for optimizer in OPTIMIZERS:
        cause = dev.cause_for(optimizer)
        assert "{" not in cause and all(f"{o} amplifies" not in cause for o in _others(optimizer)), cause
