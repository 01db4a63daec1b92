"""A split run whose trajectory alone left the full batch's is replayed step by step before it FAILs
(harness.localize.replayed): cleared and held to AdamW's reach where every step computed what the plain model
computes from the run's own parameters and gradients, still FAIL and localised where the run computed otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.core.policy import Bounds, adamw_reach
from harness.core.scenario import Scenario
from harness.core.verdict import FAIL, PASS, Verdict
from harness.localize.auto import to_localise
from harness.localize.replayed import CHECK, candidates, replay_crossings

MUTANT = "suites.mutants.catalog:bf16_optimizer_step"


def _v(sid, check=CHECK, status=FAIL, measured=1e-3, step=2):
    return Verdict(check, sid, status, measured, 1e-4, step=step, param="w")


def _replayed(impl, pool):
    """A split crossing at step 2 (as the check would report one) of `impl`'s run, replayed for real."""
    sc = Scenario(impl, "mlp", 4, "split", "adamw", steps=3, feature="bf16")  # the mutant's defect needs bf16
    [v] = replay_crossings([sc], [_v(sc.id)], pool)
    return v


def test_a_correct_run_off_the_full_batch_trajectory_is_cleared_by_its_replay(kept_worlds):
    v = _replayed("fsdp_impl", kept_worlds)
    assert v.status == PASS and "Not the implementation" in v.message, v.message
    assert v.bound == pytest.approx(adamw_reach(1e-2, 3)) and v.measured == 1e-3  # held to the reach, as measured


def test_a_wrong_optimizer_step_stays_a_failure_and_is_named(kept_worlds):
    v = _replayed(MUTANT, kept_worlds)
    assert v.status == FAIL
    assert "parted from the plain model's computation" in v.message and "optimizer step" in v.message, v.message
    # the run's localisation afterwards (harness.localize.auto) does not replay it again; an unreplayed one it does
    sc = Scenario(MUTANT, "mlp", 4, "split", "adamw", steps=3, feature="bf16")
    assert to_localise(SimpleNamespace(scenarios=[sc], verdicts=[v]), 2) == []
    assert to_localise(SimpleNamespace(scenarios=[sc], verdicts=[_v(sc.id)]), 2) == [sc]


@pytest.mark.parametrize(
    "case,expected",
    [
        ("alone", True),
        ("another failure", False),
        ("sgd", False),
        ("beyond the reach", False),
        ("resumed", False),
        ("user optimizer", False),
    ],
)
def test_only_a_lone_crossing_within_the_reach_is_replayed(case, expected):
    opt = {"sgd": "sgd", "user optimizer": "harness.train.optim:normalised_sgd"}.get(case, "adamw")
    sc = Scenario(
        "fsdp_impl",
        "mlp",
        4,
        "split",
        opt,
        steps=3,
        feature="ckpt" if case == "resumed" else "plain",
        resume_from=2 if case == "resumed" else 0,
    )
    measured = 10.0 if case == "beyond the reach" else 1e-3
    verdicts = [_v(sc.id, measured=measured)] + (
        [_v(sc.id, check="grad_norm_matches")] if case == "another failure" else []
    )
    assert bool(candidates([sc], verdicts, Bounds())) is expected
