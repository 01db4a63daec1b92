"""What the harness says of the training loop a user's model implies, before any world starts and from the plain
model's runs (suites/harness/unit/loop_models.py): a forward that draws random numbers is refused naming its
module; a loss that is a mean weighted by a count each sample carries (a token mean over the non-pad tokens) is
measured, not refused, and the difference it makes under split data is the loop's verdict, counted apart from the
implementations'."""

from __future__ import annotations

import argparse
import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.checks.loop import averaged_means_probe, loss_normalisation
from harness.checks.registry import verdict_table
from harness.core import names
from harness.core.outcome import FAILED, outcome
from harness.core.policy import Bounds
from harness.core.scenario import Scenario
from harness.core.verdict import FAIL, PASS
from harness.tables.build import scenario_fields, settings
from harness.train.models import get_model_spec
from harness.train.user_models import (
    SAMPLE_MEAN,
    WEIGHTED_MEAN,
    ModelError,
    RandomForwardError,
    check_model,
    normaliser_shares,
    random_draws,
)
from suites.harness.unit import loop_models

LOOP = "suites.harness.unit.loop_models:"

# -- a forward that draws random numbers ---------------------------------------------------------------------------


def test_a_forward_with_dropout_is_refused_naming_the_module_that_drew():
    with pytest.raises(RandomForwardError) as err:
        check_model(loop_models.dropout_mlp, 16, 0)
    assert err.value.module == "blocks.0.drop"  # the first module whose forward drew, by its path in the model
    assert err.value.ops == ("aten.bernoulli_",)
    assert "\n" not in str(err.value)


def test_the_preflight_refuses_it_with_one_usage_line():
    from harness.options import MatrixOptions
    from harness.preflight import check

    matrix = MatrixOptions(
        impls=("fsdp_impl",),
        models=(LOOP + "dropout_mlp",),
        world_sizes=(1, 2),
        data_modes=("split",),
        optimizers=("adamw",),
        steps=2,
    )
    with pytest.raises(argparse.ArgumentTypeError) as err:
        check(matrix)
    assert "\n" not in str(err.value) and str(err.value).startswith("--models: ")


def test_the_same_model_with_dropout_off_is_held_like_any_other():
    assert check_model(loop_models.dropout_off_mlp, 16, 0) == SAMPLE_MEAN


class _Noisy(nn.Module):
    """Noise injected in a submodule's forward with randn_like, no dropout module in sight."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.noise = _AddNoise()

    def forward(self, x):
        return self.noise(self.inner(x))


class _AddNoise(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


class _Attention(nn.Module):
    """Fused attention (F.scaled_dot_product_attention), whose CPU kernel torch tags random whatever its dropout_p."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.proj, self.p = nn.Linear(4, 12), p

    def forward(self, x):
        q, k, v = self.proj(x).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p).squeeze(1)


def test_any_random_op_counts_and_names_its_module():
    draws = random_draws("noisy", _Noisy(), torch.randn(2, 3, 4))
    assert [m for m, _ in draws] == ["noise"] and draws[0][1].startswith("aten.randn")


def test_a_fused_attention_kernel_draws_only_with_a_dropout_probability():
    x = torch.randn(2, 3, 4)
    assert random_draws("attn", _Attention(0.0), x) == []
    assert [m for m, _ in random_draws("attn", _Attention(0.3), x)] == [""]  # the root's own forward


_LARGE = ("gpt2_medium", "lm_50m")  # built on the meta device: the detector sees a meta tensor's ops all the same


@pytest.mark.parametrize("name", list(names.MODELS) + list(names.STANDARD_MODELS) + list(names.HF_MODELS))
def test_no_model_of_the_harness_draws_random_numbers(name):
    """The zoo, the standard architectures and the Hugging Face models (dropout set to 0 where they have it) pass
    the preflight's check, in the training mode the harness leaves them in."""
    spec = get_model_spec(name)
    torch.manual_seed(0)
    device = torch.device("meta" if name in _LARGE else "cpu")
    with device:
        model = spec.build()
    assert model.training
    assert random_draws(name, model, spec.make_batch(4, 1, 0)[0].to(device)) == []


def test_the_detector_sees_a_meta_tensors_draws():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5)).to("meta")
    assert random_draws("meta", model, torch.zeros(2, 3, device="meta")) == [("1", "aten.bernoulli_")]


# -- a loss weighted by a count each sample carries (a token mean) ------------------------------------------------


def _real_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != loop_models.IGNORE).sum(dim=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_token_mean_is_measured_not_refused(seed):
    """Before this, the preflight refused such a loss or let it through as the seed had it (its loss at
    initialisation barely depends on the weighting), and split runs then failed the implementation."""
    assert check_model(loop_models.padded_gpt2, 16, seed, steps=3) == WEIGHTED_MEAN


def test_the_shares_it_reads_are_the_halves_token_counts():
    spec = loop_models.padded_gpt2
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.make_batch(16, 1, 0)
    shares = normaliser_shares(spec.name, model, spec.loss, (x, y))
    counts = _real_tokens(y)
    expected = [float(counts[i::2].sum() / counts.sum()) for i in (0, 1)]
    assert shares.weighted and shares.shares == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", [m for m in names.MODELS if m not in _LARGE] + list(names.STANDARD_MODELS))
def test_the_harness_own_losses_are_means_over_the_samples_at_every_step(name):
    assert check_model(get_model_spec(name), 16, 0, steps=3) == SAMPLE_MEAN


def test_normalised_by_the_global_count_it_is_a_mean_over_the_samples():
    assert check_model(loop_models.padded_gpt2_global, 16, 0, steps=3) == SAMPLE_MEAN


def test_a_sum_of_token_losses_and_a_contrastive_loss_are_still_refused():
    summed = loop_models.padded_gpt2.__class__(
        "summed",
        loop_models.PaddedCausalLM,
        loop_models.padded_batch,
        lambda out, y: F.cross_entropy(
            out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=loop_models.IGNORE, reduction="sum"
        ),
        loop_models.blocks,
    )

    def contrastive(out, y):  # each sample's logit against every other's: the batch is its own negatives
        emb = out.mean(dim=1)
        return F.cross_entropy(emb @ emb.T, torch.arange(emb.shape[0]))

    mixing = summed.__class__("mixing", summed.build, summed.make_batch, contrastive, summed.units)
    for spec in (summed, mixing):
        with pytest.raises(ModelError) as err:
            check_model(spec, 16, 0)
        assert not isinstance(err.value, RandomForwardError) and "\n" not in str(err.value)


# -- loss_normalisation: the loop's verdict, from the plain model's runs ------------------------------------------

MODEL = LOOP + "padded_gpt2"
NORM, LOSS = 1.5, 3.25


def _tables(probe_norm: float, weighted: bool = True) -> tuple[dict, Scenario, Scenario]:
    """A split run at 2 ranks, its full-batch reference and its rank-order probe (the ranks' own means averaged), at
    3 steps; the probe's step-1 gradient norm `probe_norm` against the reference's NORM."""
    run = Scenario("fsdp_impl", MODEL, 2, "split", "adamw", steps=3)
    ref, probe = run.reference(), run.rank_order_probe()
    rows, steps = [], []
    for sc, norm in ((ref, NORM), (probe, probe_norm), (run, probe_norm)):
        rows.append({**scenario_fields(sc), **settings(sc), "status": "ok", "weighted_loss": weighted})
        for step in (1, 2, 3):
            steps.append(
                {
                    "scenario": sc.id,
                    "step": step,
                    "loss": LOSS / step,
                    "grad_norm": norm / step,
                    "max_diff_ref": 0.0 if sc == ref else 0.01 * step,
                    "worst_param_ref": "lm.transformer.h.0.attn.c_attn.weight",
                }
            )
    return {"scenarios": pd.DataFrame(rows), "steps": pd.DataFrame(steps)}, run, probe


def test_the_ranks_own_means_apart_from_the_global_mean_fail_the_loop_on_the_plain_models_run():
    tables, run, probe = _tables(NORM * 1.01)
    (v,) = loss_normalisation(tables)
    assert (v.check, v.scenario, v.status, v.step, v.param) == (
        "loss_normalisation",
        probe.id,
        FAIL,
        1,
        "gradient norm",
    )
    assert v.measured == pytest.approx(0.01) and v.bound == Bounds().grad_norm_rel
    # counted with the yardstick, apart from the implementations': the run fails, no implementation does
    o = outcome(tables["scenarios"], verdict_table([v]))
    assert o.word == FAILED and o.counts[FAIL] == 0 and o.reference[FAIL] == 1


def test_counts_that_normalise_alike_pass():
    within = NORM * (1 + Bounds().grad_norm_rel / 2)
    (v,) = loss_normalisation(_tables(within)[0])
    assert v.status == PASS and v.measured <= v.bound


def test_a_mean_over_the_samples_gets_no_such_verdict():
    tables, _, probe = _tables(NORM * 1.01, weighted=False)
    assert loss_normalisation(tables) == []
    assert not averaged_means_probe(next(tables["scenarios"].itertuples()))


def test_only_the_rank_order_probe_is_held():
    tables, run, probe = _tables(NORM * 1.01)
    held = [r.scenario for r in tables["scenarios"].itertuples() if averaged_means_probe(r)]
    assert held == [probe.id] and run.id not in held and math.isfinite(NORM)
