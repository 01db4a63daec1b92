"""Hugging Face `transformers` decoders as harness models: ``--models hf:gpt2,hf:llama``.

Optional extra (``pip install -e .[hf]``). Each model is built from a config (no download, no
network): ``GPT2LMHeadModel`` and ``LlamaForCausalLM``, 2 layers, hidden size 32, 4 heads, input
embedding and output head TIED (``tie_word_embeddings=True``), so the tie is held the way real
GPT-2 and many Llama-family checkpoints hold it. Sizes: hf:gpt2 30,432 parameters (vocab 131, an odd
size like GPT-2's 50257, so shards need padding; 24 positions), hf:llama 28,960 (vocab 128, SwiGLU
86). Both train on the zoo's token sequences (`lm_batch`, length 16) with the zoo's next-token loss.

Determinism, so that a sharded run can equal the plain model bit for bit:

* every dropout probability is 0 (the harness never calls ``eval()``);
* ``attn_implementation="eager"``: attention as plain matmul + softmax, the same kernels on every
  backend. ``"sdpa"`` can be as reproducible on CPU (reports/measured_behaviour.md#hugging-face-models),
  but it differs from eager in the last bits and on CUDA may pick the flash / memory-efficient kernels,
  whose backward is not deterministic;
* ``use_cache=False``: forward returns no key/value cache.

The root returns the logits tensor (the harness calls ``spec.loss(model(x), y)``): `LogitsOnly`
holds the Hugging Face model as ``.lm``. Units are the decoder blocks, bottom-up; the tied
embedding and head, the position embedding (GPT-2) and the final norm stay in the root. Buffers are
never sharded: Llama's rotary ``inv_freq`` (in the root in transformers 5; in 4.40 each block's
attention holds it with cos/sin caches, and each GPT-2 block a causal-mask ``bias``) is the same
on every rank, bitwise with transformers 4 and 5 (reports/measured_behaviour.md#hugging-face-models).
``build()`` seeds nothing:
Hugging Face's own initialization (normal, std 0.02) draws from the global torch RNG the harness
seeded. Unlike the zoo's models these are not meta-initializable to equal values
(`materialize_meta` calls torch's ``reset_parameters``, not Hugging Face's init).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from harness.core.loading import one_line
from harness.core.names import unknown_hf_model
from harness.train.model_spec import ModelSpec, lm_batch, lm_loss
from harness.train.user_models import ModelError

SEQ_LEN = 16  # tokens per sample make_batch returns (within both models' context)
INSTALL = "pip install -e .[hf]"

NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
COMMON = dict(
    tie_word_embeddings=True, use_cache=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0
)  # ids inside the small vocab (GPT-2's default 50256 is not)

GPT2 = dict(vocab_size=131, n_positions=24, n_embd=32, n_layer=2, n_head=4, **NO_DROPOUT_GPT2, **COMMON)
LLAMA = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=86,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=24,
    attention_dropout=0.0,
    **COMMON,
)


class LogitsOnly(nn.Module):
    """A Hugging Face causal LM whose forward takes input_ids [B, T] and returns the logits [B, T, V]."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids).logits


def _gpt2() -> LogitsOnly:
    from transformers import GPT2Config, GPT2LMHeadModel

    return LogitsOnly(GPT2LMHeadModel(GPT2Config(**GPT2)))


def _llama() -> LogitsOnly:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LogitsOnly(LlamaForCausalLM(LlamaConfig(**LLAMA)))


def _spec(
    name: str, build: Callable[[], LogitsOnly], vocab: int, blocks: Callable[[nn.Module], nn.ModuleList]
) -> ModelSpec:
    return ModelSpec(
        name=name,
        build=build,
        make_batch=lambda n, step, seed: lm_batch(vocab, SEQ_LEN, n, step, seed),
        loss=lm_loss,
        units=lambda model: list(blocks(model.lm)),  # the blocks only: the tied embedding and head stay in the root
    )


# the registry behind harness.core.names.HF_MODELS (the names the command line accepts)
HF_SPECS: dict[str, ModelSpec] = {
    "hf:gpt2": _spec("hf:gpt2", _gpt2, GPT2["vocab_size"], lambda lm: lm.transformer.h),
    "hf:llama": _spec("hf:llama", _llama, LLAMA["vocab_size"], lambda lm: lm.model.layers),
}


def hf_model_spec(name: str) -> ModelSpec:
    """The spec for ``"hf:<model>"``; ModelError (one line) for an unknown name or without transformers."""
    if name not in HF_SPECS:
        raise ModelError(unknown_hf_model(name))
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ModelError(
            f"model {name!r} needs Hugging Face transformers, which is not importable ({one_line(exc)}): {INSTALL}"
        ) from None
    return HF_SPECS[name]
