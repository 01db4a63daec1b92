"""Implementations that drive their own step (harness.adapters.base's engine hooks): the harness runs every
feature's step through the engine's backward, step and zero_grad, the engine owns its accumulation boundary, and
an engine that gets the boundary or the loss scale wrong is caught.

The engine (engine_adapters.py) averages the ranks' gradients only inside its step hook: were the hooks not
called, a split run at W = 2 would train two unaveraged replicas and fail."""

from __future__ import annotations

import pytest

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

ENGINES = "suites.harness.end_to_end.engine_adapters"
FEATURES = ("plain", "accum", "clip", "clip_inf", "accum+clip", "eval", "jitter")


def _run(engine: str, features, pool, modes=("replicated", "split")):
    scenarios = build_matrix(
        [f"{ENGINES}:{engine}"], ["mlp"], [1, 2], modes, ["adamw"], steps=3, features=tuple(features)
    )
    return run_matrix(scenarios, pool=pool)


@pytest.fixture(scope="module")
def correct(kept_worlds):
    return _run("replica_engine", FEATURES, kept_worlds)


def test_an_engine_that_drives_its_own_step_passes_every_feature_it_runs(correct):
    failed = [str(v) for v in correct.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    mine = [v for v in correct.verdicts if v.check == "completed" and v.scenario.startswith(ENGINES.replace(":", "."))]
    assert {v.status for v in mine} == {PASS} and len(mine) == 2 * 2 * len(FEATURES)  # W 1, 2 x two modes


def test_the_engines_applied_gradient_is_what_the_step_norm_holds(correct):
    """The gradient an engine reduces lives in its own buffers until its optimizer steps: the harness reads the
    norm there (harness.measure.applied), and it matches the plain model's at step 1."""
    held = [v for v in correct.verdicts if v.check == "grad_norm_matches" and "-ws2-split-" in v.scenario]
    assert held and all(v.status == PASS for v in held), [str(v) for v in held]


@pytest.mark.parametrize("engine", ["steps_every_micro_batch", "loss_scaled_twice"])
def test_an_engine_that_gets_its_accumulation_wrong_is_caught(engine, kept_worlds):
    res = _run(engine, ("accum",), kept_worlds, modes=("replicated",))
    failed = {
        (v.check, v.scenario) for v in res.verdicts if v.status == FAIL and not v.scenario.startswith("reference")
    }
    assert any(check == "ws1_exact" and "-ws1-" in sid for check, sid in failed), failed


def test_an_engine_that_clips_is_held_to_the_clipped_norm_and_one_that_does_not_is_caught(correct, kept_worlds):
    """Clipping inside the engine's step: the gradient it applied has max_norm's norm at every step (clip_acts) and
    the plain model's clipped step-1 norm (grad_norm_matches); an engine that declares clipping and skips it fails
    both."""
    held = [v for v in correct.verdicts if v.check in ("clip_acts", "grad_norm_matches") and "-clip" in v.scenario]
    assert {v.check for v in held} == {"clip_acts", "grad_norm_matches"} and all(v.status == PASS for v in held)
    res = _run("clip_ignored", ("clip", "clip_inf"), kept_worlds, modes=("split",))
    failed = {v.check for v in res.verdicts if v.status == FAIL and not v.scenario.startswith("reference")}
    assert {"clip_acts", "grad_norm_matches"} <= failed, failed
