"""Seeded model zoo: plain ``nn.Module``s that know nothing of parallelism.

Init property (what meta-device builds rely on): every parameter is owned by a LEAF module
(no child owns parameters) and is initialized by that module's own constructor through its
``reset_parameters()``, using the global torch RNG. Leaves are constructed in the order
``model.modules()`` visits them. So::

    torch.manual_seed(s); eager = spec.build()
    with torch.device("meta"): m = spec.build()
    torch.manual_seed(s); materialize_meta(m)   # per module, modules() order: to_empty + reset

gives parameters ``torch.equal`` to ``eager``. A tied parameter is materialized once, by the
first module that owns it (the embedding); the tied head's ``reset_parameters`` is a no-op.
Rotary tables are recomputed in ``forward`` (no buffers), so the meta build has no state
that ``reset_parameters`` does not restore.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.core.names import HF_MODELS, HF_PREFIX, STANDARD_MODELS
from harness.train.hf_models import hf_model_spec
from harness.train.model_spec import ModelSpec, data_generator, lm_batch, lm_loss
from harness.train.standard_models import STANDARD_MODELS as standard
from harness.train.user_models import load_user_model


def materialize_meta(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give every meta parameter storage on `device` and re-run its owner's reset_parameters().

    Modules are visited in ``model.modules()`` order; the caller seeds the global RNG first.
    A parameter shared by several modules (tied weights) is materialized once and the same new
    ``Parameter`` is installed in every owner, so ties survive.
    """
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        fresh = False
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                if not p.is_meta:
                    continue
                done[id(p)] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                fresh = True
            setattr(module, name, done[id(p)])
        if fresh and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


# ---------------------------------------------------------------------------------------- MLP

MLP_SIZES = (13, 37, 29, 7)  # none divides by 2, 3, 4 or 8: every shard boundary needs padding


class MLP(nn.Module):
    """Linear -> tanh -> Linear -> tanh -> Linear, with biases."""

    def __init__(self, sizes: tuple[int, ...] = MLP_SIZES) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class FrozenMLP(MLP):
    """The MLP with its first layer frozen (``requires_grad=False``), as in fine-tuning: the plain
    model's optimizer never moves it, so an implementation that does is caught."""

    def __init__(self, sizes: tuple[int, ...] = MLP_SIZES) -> None:
        super().__init__(sizes)
        self.layers[0].requires_grad_(False)


def _mlp_batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """Inputs ~ N(0, 1); targets from a fixed random teacher (same for every step), so loss falls."""
    d_in, d_out = MLP_SIZES[0], MLP_SIZES[-1]
    teacher = torch.randn(d_in, d_out, generator=data_generator("mlp-teacher", seed, 0))
    x = torch.randn(global_batch, d_in, generator=data_generator("mlp", seed, step))
    return x, torch.tanh(x @ teacher / math.sqrt(d_in))


# ------------------------------------------------------------------------------ transformer LM


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 61
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 86  # SwiGLU hidden size, ~8/3 d_model
    seq_len: int = 16  # length of the sequences make_batch returns
    context: int = 16  # longest sequence forward accepts (rotary needs no table; GPT-2: 1024)
    tied: bool = False  # output head shares the embedding weight
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight)


class OutputHead(nn.Module):
    """Logits = x @ weight.T. Tied: ``weight`` IS the embedding's Parameter and is not re-initialized."""

    def __init__(self, dim: int, vocab: int, tie_to: Embedding | None = None) -> None:
        super().__init__()
        self.tied = tie_to is not None
        self.weight = tie_to.weight if tie_to is not None else nn.Parameter(torch.empty(vocab, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.tied:
            nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.weight.shape[1]))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


def rotary(x: Tensor, theta: float) -> Tensor:
    """Rotate consecutive pairs of the last dim of x (B, H, T, hd) by position-dependent angles."""
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), inv_freq)  # (T, hd/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    """Plain matmul attention (no SDPA kernels): deterministic on every backend."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.theta = cfg.n_heads, cfg.rope_theta
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # (B, H, T, T)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.wo((probs @ v).transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)  # up
        self.w2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: embedding, blocks, final RMSNorm, output head (optionally tied)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = OutputHead(cfg.d_model, cfg.vocab, tie_to=self.embed if cfg.tied else None)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.shape[-1] > self.cfg.context:
            raise ValueError(f"sequence length {tokens.shape[-1]} > context {self.cfg.context}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _lm_units(model: nn.Module) -> list[nn.Module]:
    """Each block, plus the embedding when untied. Tied: the embedding stays with the head in
    the root unit (a tied parameter must live in one unit)."""
    assert isinstance(model, TransformerLM)
    return ([] if model.cfg.tied else [model.embed]) + list(model.blocks)


def _lm_spec(name: str, cfg: LMConfig) -> ModelSpec:
    return ModelSpec(
        name=name,
        build=lambda: TransformerLM(cfg),
        make_batch=lambda n, step, seed: lm_batch(cfg.vocab, cfg.seq_len, n, step, seed),
        loss=lm_loss,
        units=_lm_units,
    )


TINYLM = LMConfig()
# GPT-2-medium scale (~355M parameters, tied like GPT-2). For memory planning: build on meta.
GPT2_MEDIUM = LMConfig(
    vocab=50257, d_model=1024, n_heads=16, n_layers=24, d_ff=2752, seq_len=32, context=1024, tied=True
)
# ~55M parameters (54,735,360), untied, short sequences: the smallest zoo LM whose step is dominated
# by real matmuls and whose parameters (and AdamW state, ~0.9 GB at W=1) are big enough that
# sharding costs show; small enough to train a few steps on a 2-core CPU (harness/bench).
LM_50M = LMConfig(vocab=16384, d_model=512, n_heads=8, n_layers=12, d_ff=1376, seq_len=32, context=32)

# tied_vocab33 (why 33 rows: _tied_vocab33_spec below)
VOCAB33 = LMConfig(vocab=33, d_model=16, n_heads=2, n_layers=1, d_ff=32, seq_len=8, context=8, tied=True)


def every_id_batch(vocab: int, seq_len: int, global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids [global_batch, seq_len] and their next tokens, in which every id of the vocabulary is an
    input and a target at every step once global_batch x seq_len >= vocab: the batch is one arithmetic
    progression mod vocab (a random start, a random stride prime to vocab) cut into rows, so its first
    vocab tokens are all the ids. Each row is a progression, learnable in context as in lm_batch. So every
    embedding row gets a gradient through its tokens, not only through the tied head."""
    g = data_generator("lm-every-id", seed, step)
    strides = [s for s in range(1, vocab) if math.gcd(s, vocab) == 1]
    start = int(torch.randint(0, vocab, (1,), generator=g))
    stride = strides[int(torch.randint(0, len(strides), (1,), generator=g))]
    at = torch.arange(global_batch).unsqueeze(1) * seq_len + torch.arange(seq_len + 1)  # row i: i x T .. i x T + T
    seq = (start + stride * at) % vocab
    return seq[:, :-1], seq[:, 1:]


def _tied_vocab33_spec() -> ModelSpec:
    """A 1-block decoder (d_model 16, 2 heads) whose TIED vocabulary has 4 x 8 + 1 = 33 rows, trained on
    batches that hold every id as an input and a target (every_id_batch), so every row trains.

    Why 33: no world size of the matrix divides it (2, 4, 8), and at 8 ranks its layout is one no other
    zoo parameter has. Shard(0) gives each rank c = ceil(33 / W) rows: 17 + 16 at W = 2, 9 + 9 + 9 + 6 at
    W = 4, and at W = 8 five rows to ranks 0-5, the last 3 rows (30-32) to rank 6 and none to rank 7
    (5 x 7 = 35 > 33): a rank before the last holds a short chunk (more than none, fewer than c). The mlp's
    37, 29 and 7 rows and tinylm's 61 and 86 are uneven too, but their short chunk is the last rank's (7 rows
    at 8 ranks: one row on each of ranks 0-6, a full chunk, none on rank 7). Every other dimension (16, 32)
    divides by 8, so the vocabulary is the model's only uneven parameter: a fault that shows on it is the
    vocabulary's. The tie keeps embedding and head in the root unit (_lm_units)."""
    return ModelSpec(
        "tied_vocab33",
        lambda: TransformerLM(VOCAB33),
        lambda n, step, seed: every_id_batch(VOCAB33.vocab, VOCAB33.seq_len, n, step, seed),
        lm_loss,
        _lm_units,
    )


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", MLP, _mlp_batch, F.mse_loss, lambda m: list(m.layers)),
    "mlp_frozen": ModelSpec("mlp_frozen", FrozenMLP, _mlp_batch, F.mse_loss, lambda m: list(m.layers)),
    "tinylm": _lm_spec("tinylm", TINYLM),
    "tinylm_tied": _lm_spec("tinylm_tied", LMConfig(tied=True)),
    "tied_vocab33": _tied_vocab33_spec(),
    "gpt2_medium": _lm_spec("gpt2_medium", GPT2_MEDIUM),
    "lm_50m": _lm_spec("lm_50m", LM_50M),
}


def get_model_spec(name: str) -> ModelSpec:
    """A zoo model by name, a Hugging Face model ``"hf:gpt2"`` (harness/train/hf_models.py, optional
    extra), or the user's ``"package.module:factory"`` (harness/train/user_models.py)."""
    if name in MODELS:
        return MODELS[name]
    if name in STANDARD_MODELS:
        return standard[name]
    if name.startswith(HF_PREFIX):  # before the user's form: 'hf:gpt2' has a ':' too
        return hf_model_spec(name)
    if ":" in name:
        return load_user_model(name)
    raise ValueError(
        f"unknown model {name!r}; valid: {', '.join((*MODELS, *STANDARD_MODELS, *HF_MODELS))}, "
        f"or 'package.module:factory'"
    )
