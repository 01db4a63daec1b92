"""The batch-invariant tier (harness/invariant, ``python -m harness run --invariant``): fsdp_impl's invariant step
bitwise equal to itself at every world size of ``--world-sizes`` and to the plain model summing the same tree, in
both data modes; three faults of that step, which the default mode never runs, each caught by the tier; an
implementation that claims invariance without a step to hold it by fails, one that does not claim it is
unsupported."""

from __future__ import annotations

import pytest

from harness.core.verdict import FAIL, PASS, UNSUPPORTED
from harness.invariant.run import CHECKS, run_invariant

MUTANTS = "suites.mutants.invariant_mutants"
# the CI tier (--ci; .ci/run runs it): the harness's tier over fsdp_impl's invariant step; the step itself is held
# bitwise at every world size in the default tier by suites/fsdp_impl/test_invariant.py
pytestmark = pytest.mark.ci


@pytest.fixture(scope="module")
def world_sizes(request):
    """The run's --world-sizes (1, 2, 4, 8 in the README's test command)."""
    from harness.plugin import matrix_options

    return tuple(matrix_options(request.config).world_sizes)


@pytest.fixture(scope="module")
def tier(kept_worlds, world_sizes):
    return run_invariant(
        ["fsdp_impl"],
        ["mlp", "tinylm_tied"],
        world_sizes,
        ["split", "replicated"],
        ["adamw"],
        steps=2,
        pool=kept_worlds,
    )


def test_fsdp_impl_is_bitwise_itself_and_the_tree_at_every_world_size(tier, world_sizes):
    tables, verdicts = tier
    assert {v.check for v in verdicts} == set(CHECKS)
    assert len(verdicts) == len(CHECKS) * 2 * len(world_sizes) * 2
    bad = [str(v) for v in verdicts if v.status != PASS or v.measured != 0]
    assert not bad, "\n".join(bad)
    table = tables["invariant"]
    assert (
        len(table) == 2 * len(world_sizes) * 2 * 2 and (table.diff_tree == 0).all() and (table.diff_ws_min == 0).all()
    )


@pytest.mark.parametrize("feature", ["bf16", "ac", "clip_inf", "ckpt"])
def test_the_features_that_keep_the_mode_keep_every_world_size_bitwise(kept_worlds, feature):
    """bf16 (fp32 trees), ac, the inf-norm clip, and a run resumed at another world size (ckpt: W = 1 resumes what
    4 ranks saved, 4 what 1 saved), each against the plain model doing the same uninterrupted; both data modes;
    the slow tier runs them at every world size on both zoo models."""
    _, verdicts = run_invariant(
        ["fsdp_impl"],
        ["tinylm_tied"],
        (1, 4),
        ["split", "replicated"],
        ["adamw"],
        steps=4,
        features=(feature,),
        pool=kept_worlds,
    )
    assert len(verdicts) == len(CHECKS) * 2 * 2
    bad = [str(v) for v in verdicts if v.status != PASS or v.measured != 0]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("seed", (0, 1, 2, 3, 4))
def test_every_feature_of_the_mode_at_every_world_size_on_the_zoo_under_five_seeds(kept_worlds, world_sizes, seed):
    """No false alarm of the tier: bound 0 leaves no room for noise, so any seed's failure is a real one."""
    from harness.invariant.task import FEATURES
    from harness.options import DEFAULT_MODELS

    _, verdicts = run_invariant(
        ["fsdp_impl"],
        DEFAULT_MODELS,
        world_sizes,
        ["split", "replicated"],
        ["adamw", "sgd"],
        steps=4,
        features=FEATURES,
        seed=seed,
        pool=kept_worlds,
    )
    bad = [str(v) for v in verdicts if v.status != PASS or v.measured != 0]
    assert verdicts and not bad, "\n".join(bad)


def test_the_report_shows_the_tier_with_its_zeros(tier):
    from harness.checks.registry import verdict_table
    from harness.invariant.section import invariant_section

    tables, verdicts = tier
    lines = invariant_section({**tables, "verdicts": verdict_table(verdicts)})
    assert lines[0] == "## Batch-invariant tier" and any("runs bitwise" in ln for ln in lines)
    assert "invariant_matches_tree PASS" in "\n".join(lines)


@pytest.mark.parametrize(
    "mutant,sizes,check",
    [
        ("tree_sequential", (1, 2), "invariant_matches_tree"),  # 8 and 4 micro-batches a rank: not the tree
        ("ranks_in_rank_order", (1, 4), "invariant_across_ws"),  # 4 ranks' partial sums in rank order
        ("loss_per_rank", (1, 2), "invariant_across_ws"),  # the gradient twice too large at W = 2
    ],
)
def test_each_fault_of_the_invariant_step_is_caught_by_the_tier(kept_worlds, mutant, sizes, check):
    _, verdicts = run_invariant(
        [f"{MUTANTS}:{mutant}"], ["mlp"], sizes, ["split"], ["adamw"], steps=2, pool=kept_worlds
    )
    failed = [v for v in verdicts if v.status == FAIL]
    assert any(v.check == check for v in failed), [str(v) for v in verdicts]


def test_a_claim_without_a_step_fails_and_no_claim_is_unsupported(kept_worlds):
    _, claimed = run_invariant(
        [f"{MUTANTS}:ClaimsWithoutStep"], ["mlp"], (1,), ["split"], ["adamw"], steps=1, pool=kept_worlds
    )
    assert claimed and all(v.status == FAIL and "not measured" in v.message for v in claimed)
    _, fsdp2 = run_invariant(["torch_fsdp2"], ["mlp"], (1,), ["split"], ["adamw"], steps=1, pool=kept_worlds)
    assert fsdp2 and all(v.status == UNSUPPORTED and "batch_invariant" in v.message for v in fsdp2)
