"""What a model is to the harness (`ModelSpec`: build, make_batch, loss, units) and the data helpers that specs
share: a generator keyed by (tag, seed, step) and the language models' batches and loss. The zoo
(harness/train/models.py), the standard architectures, the Hugging Face models and a user's own spec all build on
these; none of them is imported here."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]  # uses the global torch RNG; caller seeds first
    make_batch: Callable[[int, int, int], tuple[Tensor, Tensor]]  # (global_batch, step, seed), CPU
    loss: Callable[[Tensor, Tensor], Tensor]  # mean over the (local) batch
    units: Callable[[nn.Module], list[nn.Module]]  # shard units, bottom-up; the root comes last


def data_generator(tag: str, seed: int, step: int) -> torch.Generator:
    """A CPU generator keyed by (tag, seed, step), independent of the global RNG and of hash()."""
    digest = hashlib.blake2b(f"{tag}:{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def lm_batch(vocab: int, seq_len: int, global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """Token ids [global_batch, seq_len] and their next tokens: arithmetic progressions mod vocab
    (random start and stride), learnable in context. Any language model of the zoo or beside it."""
    g = data_generator("lm", seed, step)
    start = torch.randint(0, vocab, (global_batch, 1), generator=g)
    stride = torch.randint(1, 5, (global_batch, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over every token of the batch (logits [B, T, V], targets [B, T])."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
