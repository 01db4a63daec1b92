"""A language model trained as most are, on a tiny Hugging Face GPT-2 with padded sequences of varying length, an
attention mask and the loss a mean over the non-pad tokens (suites/harness/unit/loop_models.py padded_gpt2): split
data averages the ranks' own token means, not the global one. The run names that as the training loop's verdict
on the plain model's run (loss_normalisation), holds the implementation to the computation with the same
normalisation (the ranks' micro-batches), where it passes and a faulty reduction is still caught, and the same
model with the loss normalised by the global count passes everything."""

from __future__ import annotations

import pytest

from harness.core.scenario import Scenario, build_matrix, with_dependencies
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

LOOP = "suites.harness.unit.loop_models:"
TOKEN_MEAN, GLOBAL_COUNT = LOOP + "padded_gpt2", LOOP + "padded_gpt2_global"
FAULTY = "suites.mutants.catalog:last_rank_scaled_input"  # the last rank's gradient doubled before the reduction
STEPS = 2


def _matrix(impls, world_sizes):
    """Each correct implementation on both models; the faulty reduction on the token mean alone."""
    correct = [i for i in impls if i != FAULTY]
    cells = build_matrix(correct, [TOKEN_MEAN, GLOBAL_COUNT], world_sizes, ["split"], ["adamw"], steps=STEPS)
    if FAULTY in impls:
        cells += build_matrix([FAULTY], [TOKEN_MEAN], world_sizes, ["split"], ["adamw"], steps=STEPS)
    return with_dependencies(list(dict.fromkeys(cells)))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((("fsdp_impl", FAULTY), (1, 2)), id="fsdp_impl-ws2"),
        pytest.param((("torch_fsdp2",), (1, 2, 4)), id="fsdp2-ws4", marks=pytest.mark.ci),
    ],
)
def run(request, kept_worlds):
    impls, world_sizes = request.param
    return impls, world_sizes, run_matrix(_matrix(impls, world_sizes), pool=kept_worlds)


def _of(res, scenario_id):
    return {v.check: v for v in res.verdicts if v.scenario == scenario_id}


def test_the_ranks_own_token_means_fail_the_training_loop_on_the_plain_models_run(run):
    impls, world_sizes, res = run
    for w in world_sizes[1:]:
        probe = Scenario(impls[0], TOKEN_MEAN, w, "split", "adamw", steps=STEPS).rank_order_probe()
        v = _of(res, probe.id)["loss_normalisation"]
        assert (v.status, v.step, v.param) == (FAIL, 1, "gradient norm")
        assert v.measured > 100 * v.bound  # not rounding: the per-rank counts differ by whole tokens


def test_the_implementation_is_held_to_the_same_normalisation_and_passes(run):
    impls, world_sizes, res = run
    for model in (TOKEN_MEAN, GLOBAL_COUNT):
        for w in world_sizes:
            verdicts = _of(res, Scenario(impls[0], model, w, "split", "adamw", steps=STEPS).id)
            assert verdicts and all(v.status != FAIL for v in verdicts.values()), [
                str(v) for v in verdicts.values() if v.status == FAIL
            ]
            if w > 1:
                assert verdicts["split_matches_full_batch"].status == PASS
                assert verdicts["grad_norm_matches"].status == PASS


def test_the_loss_normalised_by_the_global_count_gets_no_loop_verdict(run):
    impls, _, res = run
    loop = [v for v in res.verdicts if v.check == "loss_normalisation"]
    assert loop and all(TOKEN_MEAN.replace(":", ".") in v.scenario for v in loop)
    correct = [
        v
        for v in res.verdicts
        if GLOBAL_COUNT.replace(":", ".") in v.scenario and v.scenario.startswith((impls[0], "reference"))
    ]
    assert correct and not any(v.status == FAIL for v in correct), [str(v) for v in correct if v.status == FAIL]


def test_a_faulty_reduction_is_still_caught_against_the_same_normalisation(run):
    impls, _, res = run
    if FAULTY not in impls:
        pytest.skip("the faulty reduction runs in the default cell")
    v = _of(res, Scenario(FAULTY, TOKEN_MEAN, 2, "split", "adamw", steps=STEPS).id)["grad_norm_matches"]
    assert (v.status, v.step) == (FAIL, 1)
