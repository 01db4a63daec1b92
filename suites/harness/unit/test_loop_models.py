"""What the harness says of the training loop a user's model implies, before any world starts
(suites/harness/unit/loop_models.py): a forward that draws random numbers is refused naming its module."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.core import names
from harness.train.models import get_model_spec
from harness.train.user_models import RandomForwardError, check_model, random_draws
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
    check_model(loop_models.dropout_off_mlp, 16, 0)


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
