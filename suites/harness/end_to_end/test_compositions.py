"""Features composed in one run (`--features hsdp+clip`): each composition compared with the plain model
doing the same composition, bounds composed by the rule in harness/core/policy.py [Note: compositions].

CI runs the everyday pairs on fsdp_impl and FSDP2 (mlp, AdamW, 3 steps, each in the data mode where its bug
class shows: DEFAULT_MODE; both with --slow) at W 1, 2, those with hsdp (2 replicas x W/2 shards, which shards
nothing at W = 2) at W 1, 4 instead; every supported pair
runs in the slow tier (`--slow`), and the CI pairs at W 1, 2, 4 on fsdp_impl, FSDP2 and DDP over five seeds
(the false-alarm test below)."""

from __future__ import annotations

import itertools
import re

import pytest

from harness.core.features import FEATURES, check_feature, conflicting_pairs, has, parts
from harness.core.scenario import Scenario, build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix
from suites.mutants.false_alarms import CI_COMPOSITIONS, SEEDS, composition_matrix, run_false_alarms

IMPLS = ("fsdp_impl", "torch_fsdp2")


def every_pair() -> list[str]:
    """Every pair of features that composes (the pairs of one scheme left out)."""
    names = [f for f in FEATURES if f != "plain"]
    conflicts = set(conflicting_pairs())
    return [f"{a}+{b}" for a, b in itertools.combinations(names, 2) if (a, b) not in conflicts]


def _matrix(compositions, world_sizes, steps, modes=("replicated", "split")):
    return build_matrix(
        IMPLS,
        ["mlp"],
        list(world_sizes),
        modes,
        ("adamw",),
        steps=steps,
        features=tuple(check_feature(c) for c in compositions),
    )


# The default tier runs each CI composition in the data mode where its bug class shows (both with --slow):
# split data where replicas or micro-batches must differ for the fault to matter (hybrid sharding's replicas
# average different gradients, hsdp+clip's norm group, hsdp+no_sync's replica agreement, bf16+accum's
# micro-batch rounding: the bf16_summed mutant is caught there), replicated data, where every check is bitwise
# against the plain model, for the rest.
DEFAULT_MODE = {"hsdp+clip": "split", "hsdp+no_sync": "split", "bf16+accum": "split", "bf16+hsdp": "split"}


def _ci_matrix(slow: bool) -> list[Scenario]:
    scenarios = []
    for comp in CI_COMPOSITIONS:
        modes = ("replicated", "split") if slow else (DEFAULT_MODE.get(comp, "replicated"),)
        sizes = (1, 4) if has(comp, "hsdp") else (1, 2)  # 2 replicas x 2 shards: W = 2 would shard nothing
        scenarios += [s for s in _matrix([comp], sizes, 3, modes) if s not in scenarios]
    return scenarios


def _run(compositions, world_sizes, steps, pool=None):
    scenarios = _matrix(compositions, world_sizes, steps)
    return scenarios, run_matrix(scenarios, pool=pool)


@pytest.fixture(scope="module")
def ci_run(kept_worlds, request):
    scenarios = _ci_matrix(request.config.getoption("--slow", default=False))
    return scenarios, run_matrix(scenarios, pool=kept_worlds)


def test_the_ci_compositions_run_and_pass_for_fsdp_impl_and_fsdp2(ci_run):
    scenarios, res = ci_run
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    ran = {v.scenario for v in res.verdicts if v.check == "completed" and v.status == PASS}
    for comp in map(check_feature, CI_COMPOSITIONS):
        mine = [s for s in scenarios if s.feature == comp and s.impl in IMPLS and s.world_size > 1]
        assert mine and all(s.id in ran for s in mine), comp


def test_each_composition_is_compared_with_the_plain_model_doing_the_same(ci_run):
    """The reference keeps every part that changes the numbers (hsdp, ac and ckpt leave them as the plain
    step has them); a resumed run's saver runs the composition without ckpt."""
    sc = Scenario("fsdp_impl", "mlp", 2, "split", "adamw", feature="clip+hsdp")
    assert sc.feature == "clip+hsdp" and sc.reference().feature == "clip"
    assert Scenario("fsdp_impl", "mlp", 2, "split", "adamw", feature="accum+bf16").reference().feature == "accum+bf16"
    resumed = Scenario("fsdp_impl", "mlp", 2, "replicated", "adamw", feature="bf16+ckpt", resume_from=4)
    assert resumed.saver().feature == "bf16" and resumed.saver().world_size == 4
    # the checks see each part: clipping acted, the replicas agree, the checkpoint restored
    _, res = ci_run
    seen = {(v.check, s) for v in res.verdicts for s in [v.scenario] if v.status == PASS}
    for check, comp in (
        ("clip_acts", "hsdp+clip"),
        ("replicas_agree", "hsdp+no_sync"),
        ("ckpt_restored", "ckpt+no_sync"),
        ("ckpt_restored", "hsdp+ckpt"),
    ):
        assert any(c == check and f"-{check_feature(comp)}" in s for c, s in seen), (check, comp)


def test_a_composition_that_cannot_be_composed_is_refused_in_one_line():
    for bad, why in (
        ("accum+no_sync", "two micro-batch schemes"),
        ("clip+clip_inf", "two clipping norms"),
        ("hsdp+bogus", "unknown feature 'bogus' in 'hsdp+bogus'"),
        ("clip+clip", "names a feature twice"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            check_feature(bad)
    assert check_feature("clip+hsdp") == check_feature("hsdp+clip") and parts("hsdp+clip") == ("clip", "hsdp")


@pytest.mark.slow
def test_every_supported_pair_passes_for_fsdp_impl_and_fsdp2():
    _, res = _run(every_pair(), (1, 2, 4), steps=4)
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_the_ci_compositions_raise_no_false_alarm_on_fsdp_impl_fsdp2_and_ddp(kept_worlds, seed):
    """Issue 25 item 8: five seeds (init and data) of every CI composition on the three correct
    implementations (DDP where it can run the parts); the score report's table: `python -m
    reports.mutation_score --composition-seeds 0,1,2,3,4`."""
    run = run_false_alarms(composition_matrix(seed), seed=seed, pool=kept_worlds)
    assert not run.unjudged, sorted(run.unjudged)
    failed = [str(v) for v in run.false_alarms]
    assert not failed, "\n".join(failed)
