"""Hugging Face models under the harness (`--models hf:gpt2,hf:llama`, harness/train/hf_models.py):
GPT-2 and Llama with tied embeddings train bitwise like the plain model under fsdp_impl and FSDP2,
the built models keep the tie in the root, and a bad name or a missing transformers is one line.

These tests need the `hf` extra (`pip install -e .[hf]`, which CI installs). Without transformers
the tests that build a model FAIL, saying so, rather than skip: a skip would hide that they never ran."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch
from torch import nn

from harness import options
from harness.core import names
from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix
from harness.train.hf_models import HF_SPECS, INSTALL
from harness.train.models import get_model_spec
from harness.train.user_models import ModelError, check_batch, check_built

HF = list(names.HF_MODELS)
BLOCK_TYPES = {"hf:gpt2": "GPT2Block", "hf:llama": "LlamaDecoderLayer"}


def need_transformers() -> None:
    """FAIL (not skip) the calling test when transformers is missing, naming the extra to install."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        missing = f"{type(exc).__name__}: {exc}"
    else:
        return
    pytest.fail(
        f"Hugging Face transformers is not importable ({missing}); install the extra: {INSTALL} "
        f"(these tests fail rather than skip, so that CI cannot silently miss them)",
        pytrace=False,
    )


@pytest.fixture(scope="module")
def worlds(kept_worlds):
    return kept_worlds


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return get_model_spec(name).build()


# -- through the harness -----------------------------------------------------------------------------


@pytest.mark.ci  # 24 scenarios of two real HF models; suites/harness/end_to_end/test_standard_models.py is the default tier's
def test_hf_models_train_like_the_plain_model_sharded(worlds, request):
    """Replicated data, where the checks are bitwise; split data too with --slow (what a model changes about
    split data, the noise floor of its parameters, the standard architectures' tier holds on hf:gpt2 with
    every feature, suites/mutants/test_false_alarms.py)."""
    need_transformers()
    modes = ("replicated", "split") if request.config.getoption("--slow", default=False) else ("replicated",)
    scenarios = build_matrix(["fsdp_impl", "torch_fsdp2"], HF, [1, 2], modes, ("adamw",), steps=3)
    res = run_matrix(scenarios, pool=worlds)
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    assert {v.scenario for v in res.verdicts} >= {s.id for s in scenarios}
    # the bitwise checks ran and held: one rank equals the reference, two replicated ranks equal one
    for check, ids in (
        ("ws1_exact", [s.id for s in scenarios if s.impl != "reference" and s.world_size == 1]),
        (
            "grads_match_ws1",
            [s.id for s in scenarios if s.impl != "reference" and s.world_size == 2 and s.data_mode == "replicated"],
        ),
    ):
        got = {v.scenario: v for v in res.verdicts if v.check == check}
        assert ids and set(ids) <= set(got), f"{check} missing for {sorted(set(ids) - set(got))}"
        assert all(got[i].status == PASS and got[i].measured == 0 for i in ids), [str(got[i]) for i in ids]


# -- the models ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HF)
def test_the_tied_embedding_and_head_stay_in_the_root_and_the_units_are_the_blocks(name):
    need_transformers()
    spec = get_model_spec(name)
    model = _build(name)
    units = spec.units(model)
    check_built(name, model, units)
    embedding = model.lm.get_input_embeddings().weight
    assert embedding is model.lm.get_output_embeddings().weight  # one Parameter, not two equal ones
    assert sum(p is embedding for p in model.parameters()) == 1
    assert all(p is not embedding for u in units for p in u.parameters())
    # the blocks, bottom-up: every module of the block type, in module order
    blocks = [m for m in model.modules() if type(m).__name__ == BLOCK_TYPES[name]]
    assert len(blocks) >= 2 and [id(u) for u in units] == [id(b) for b in blocks]
    assert sum(p.numel() for p in model.parameters()) < 100_000  # small enough for 8 ranks on 2 cores


@pytest.mark.parametrize("name", HF)
def test_a_built_model_is_seeded_by_the_caller_and_returns_reproducible_logits(name):
    need_transformers()
    spec = get_model_spec(name)
    a, b, c = _build(name, seed=0), _build(name, seed=0), _build(name, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert a.training  # as the harness trains it: no dropout may act
    x, _ = spec.make_batch(4, 1, 0)
    logits = a(x)
    assert type(logits) is torch.Tensor and logits.shape == (*x.shape, a.lm.config.vocab_size)
    assert torch.equal(logits, a(x))
    assert torch.equal(logits[1:3], a(x[1:3]))  # a sample's logits do not depend on the rest of the batch


@pytest.mark.parametrize("name", HF)
def test_make_batch_is_a_function_of_batch_step_and_seed_with_next_token_targets(name):
    need_transformers()
    spec = get_model_spec(name)
    x, y = spec.make_batch(8, 2, 0)
    check_batch(name, (x, y), 8)
    assert x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    vocab = _build(name).lm.config.vocab_size
    assert int(x.min()) >= 0 and int(torch.cat([x, y]).max()) < vocab
    assert all(torch.equal(u, v) for u, v in zip((x, y), spec.make_batch(8, 2, 0)))
    assert not torch.equal(x, spec.make_batch(8, 3, 0)[0])
    assert not torch.equal(x, spec.make_batch(8, 2, 1)[0])


@pytest.mark.parametrize("name", HF)
def test_the_loss_is_the_mean_next_token_cross_entropy(name):
    need_transformers()
    spec = get_model_spec(name)
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    picked = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1))
    torch.testing.assert_close(spec.loss(logits, targets), -picked.mean())


# -- names and errors ----------------------------------------------------------------------------------


def test_the_hf_names_are_the_registry():
    assert tuple(HF_SPECS) == names.HF_MODELS


def test_an_unknown_hf_name_is_one_line_listing_the_names():
    with pytest.raises(ModelError) as err:
        get_model_spec("hf:xyz")
    assert "\n" not in str(err.value) and "'hf:xyz'" in str(err.value) and "hf:gpt2, hf:llama" in str(err.value)
    with pytest.raises(argparse.ArgumentTypeError, match="valid: hf:gpt2, hf:llama"):
        options.models("mlp,hf:xyz")


def test_without_transformers_an_hf_name_is_refused_in_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for resolve, error in ((get_model_spec, ModelError), (options.models, argparse.ArgumentTypeError)):
        with pytest.raises(error) as err:
            resolve("hf:gpt2")
        message = str(err.value)
        assert "\n" not in message and "'hf:gpt2'" in message and "pip install -e .[hf]" in message, message
    assert options.models("mlp,tinylm_tied") == ("mlp", "tinylm_tied")  # the zoo needs no transformers


def test_a_known_hf_name_is_accepted_at_parse_time():
    need_transformers()
    assert options.models("hf:gpt2,mlp,hf:llama") == ("hf:gpt2", "mlp", "hf:llama")
