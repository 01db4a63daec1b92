"""Standard architectures built from torch's own layers, as a user writes them (``--models mha_lm,...``).

The zoo of `harness.train.models` is written for the harness; these are not. Each holds a trait that
real models have and the zoo lacks, which a verdict must survive without blaming the implementation:

* ``mha_lm``: two pre-norm blocks of ``nn.MultiheadAttention`` (with its input and output biases) and a
  GELU MLP, tied embedding and head, vocabulary 37. The key part of ``in_proj_bias`` has a true gradient
  of zero (softmax is invariant to a constant added to every key), so its computed gradient is rounding
  noise whose sign depends on the order of summation, and AdamW turns it into a step of about lr
  (harness/core/policy.py, NOISE_FLOOR).
* ``encoder_lm``: two ``nn.TransformerEncoderLayer`` (post-norm, ReLU, biases) under a causal mask, an
  ``nn.Embedding`` with ``padding_idx`` (its padding row's gradient is exactly zero, so it never moves),
  an untied head with a bias.
* ``bn_mlp``: an MLP with ``nn.BatchNorm1d`` after each hidden layer. In training, batch normalisation
  uses the statistics of the batch it is given, so with split data each rank normalises its own slice:
  not the full batch's computation unless the model uses SyncBatchNorm. The harness holds such runs to
  the plain model summing the same per-rank micro-batches instead (harness.core.scenario.noise_probe).

Every dropout probability is 0 (the harness never calls ``eval()``). Unlike the zoo's models these are
not meta-initializable to equal values: ``nn.MultiheadAttention`` initialises its own parameters and
its child's in one ``_reset_parameters``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.model_spec import ModelSpec, data_generator, lm_batch, lm_loss

VOCAB, D_MODEL, HEADS, SEQ_LEN = 37, 24, 4, 12


def _causal(t: int, device) -> Tensor:
    """Boolean mask, True where a position may not attend (the future)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


class MHABlock(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x)); attention is ``nn.MultiheadAttention`` with biases."""

    def __init__(self, d: int = D_MODEL, heads: int = HEADS) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.0, bias=True, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=_causal(x.shape[1], x.device), need_weights=False)
        x = x + a
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class MHALM(nn.Module):
    """Embedding, two MHABlocks, LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, d: int = D_MODEL, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MHABlock(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.embed.weight)


class EncoderLM(nn.Module):
    """``nn.TransformerEncoderLayer`` x 2 under a causal mask; embedding with a padding row; untied head."""

    PAD = 0

    def __init__(self, vocab: int = VOCAB, d: int = D_MODEL, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=self.PAD)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, HEADS, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        mask = _causal(tokens.shape[1], tokens.device)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


BN_SIZES = (13, 29, 23, 7)


class BNMLP(nn.Module):
    """Linear -> BatchNorm1d -> tanh per hidden layer, then a Linear head."""

    def __init__(self, sizes: tuple[int, ...] = BN_SIZES) -> None:
        super().__init__()
        self.hidden = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.BatchNorm1d(b), nn.Tanh()) for a, b in zip(sizes[:-2], sizes[1:-1])
        )
        self.head = nn.Linear(sizes[-2], sizes[-1])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.hidden:
            x = layer(x)
        return self.head(x)


def _bn_batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """Inputs ~ N(0, 1) with a per-feature offset (something for the normalisation to remove); targets
    from a fixed random teacher."""
    d_in, d_out = BN_SIZES[0], BN_SIZES[-1]
    teacher = torch.randn(d_in, d_out, generator=data_generator("bn-teacher", seed, 0))
    offset = torch.randn(d_in, generator=data_generator("bn-offset", seed, 0))
    x = torch.randn(global_batch, d_in, generator=data_generator("bn", seed, step)) + offset
    return x, torch.tanh((x - offset) @ teacher / math.sqrt(d_in))


def _tokens(n: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    return lm_batch(VOCAB, SEQ_LEN, n, step, seed)


STANDARD_MODELS: dict[str, ModelSpec] = {
    "mha_lm": ModelSpec("mha_lm", MHALM, _tokens, lm_loss, lambda m: list(m.blocks)),
    "encoder_lm": ModelSpec("encoder_lm", EncoderLM, _tokens, lm_loss, lambda m: [m.embed, *m.layers]),
    "bn_mlp": ModelSpec("bn_mlp", BNMLP, _bn_batch, F.mse_loss, lambda m: list(m.hidden)),
}
