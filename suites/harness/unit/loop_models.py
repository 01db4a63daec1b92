"""Models written the way a user's training loop has them, for the tests of what the harness says of the loop
rather than of the implementation (not the zoo's):

- `dropout_mlp`: an MLP with ``nn.Dropout(0.2)`` between its layers: its forward draws random numbers;
- `dropout_off_mlp`: the same with ``p=0``, the way to verify such a model;
- `padded_gpt2`: a tiny Hugging Face GPT-2 trained on sequences of varying length, right-padded with a pad id, with
  an attention mask and labels -100 at the pads, and the loss most language models train with: the cross-entropy
  mean over the non-pad tokens (`F.cross_entropy(..., ignore_index=-100)`), so its normaliser (the batch's count
  of real tokens) varies with the batch;
- `padded_gpt2_global`: the same model and data with the fix, the loss normalised by the global batch's count: each
  sample carries that count per sample, and the loss is the token sum over the samples' shares of it, a mean over
  the batch.

Each is a `ModelSpec` named ``suites.harness.unit.loop_models:<name>``. The language models' inputs are one tensor
[B, 2, T] (token ids and the attention mask stacked), so every rank's slice cuts both by samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.models import ModelSpec, data_generator

# ---- dropout ----------------------------------------------------------------------------------------------------

D_IN, D_HIDDEN, D_OUT = 11, 24, 5


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.drop = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(F.relu(self.fc(x)))


class DropoutMLP(nn.Module):
    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(D_IN, D_HIDDEN, p), Block(D_HIDDEN, D_HIDDEN, p)])
        self.head = nn.Linear(D_HIDDEN, D_OUT)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _regression(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    teacher = torch.randn(D_IN, D_OUT, generator=data_generator("loop-teacher", seed, 0))
    x = torch.randn(global_batch, D_IN, generator=data_generator("loop-mlp", seed, step))
    return x, x @ teacher


dropout_mlp = ModelSpec("dropout_mlp", DropoutMLP, _regression, F.mse_loss, lambda m: list(m.blocks))
dropout_off_mlp = ModelSpec(
    "dropout_off_mlp", lambda: DropoutMLP(p=0.0), _regression, F.mse_loss, lambda m: list(m.blocks)
)

# ---- a padded causal language model ------------------------------------------------------------------------------

VOCAB, SEQ_LEN, PAD, IGNORE = 53, 12, 0, -100
MIN_LEN = 3  # real tokens per sample: MIN_LEN..SEQ_LEN, drawn per sample


class PaddedCausalLM(nn.Module):
    """A Hugging Face causal LM whose forward takes [B, 2, T] (ids, attention mask) and returns the logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=24,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            use_cache=False,
            attn_implementation="eager",
            bos_token_id=1,
            eos_token_id=1,
            pad_token_id=PAD,
        )
        self.lm = GPT2LMHeadModel(config)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm(input_ids=x[:, 0], attention_mask=x[:, 1]).logits


def _padded(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """(inputs [B, 2, T], labels [B, T] with IGNORE at the pads, real tokens per sample [B]): arithmetic progressions
    mod the vocabulary (ids 1..VOCAB-1; 0 is the pad), each sample of a length of its own, right-padded."""
    g = data_generator("loop-padded", seed, step)
    start = torch.randint(1, VOCAB, (global_batch, 1), generator=g)
    stride = torch.randint(1, 4, (global_batch, 1), generator=g)
    seq = (start - 1 + stride * torch.arange(SEQ_LEN + 1)) % (VOCAB - 1) + 1
    lengths = torch.randint(MIN_LEN, SEQ_LEN + 1, (global_batch,), generator=g)
    real = torch.arange(SEQ_LEN) < lengths[:, None]  # [B, T]
    ids = torch.where(real, seq[:, :-1], PAD)
    labels = torch.where(real, seq[:, 1:], IGNORE)
    return torch.stack([ids, real.long()], dim=1), labels, lengths


def padded_batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    inputs, labels, _ = _padded(global_batch, step, seed)
    return inputs, labels


def token_mean_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """The mean cross-entropy over the batch's non-pad tokens: its normaliser is this batch's count of them."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE)


def globally_counted_batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """The padded batch with each sample's share of the global batch's real tokens in a last column of the targets
    (count / global_batch, the same for every sample): the loss below divides by it, never by its slice's count."""
    inputs, labels, lengths = _padded(global_batch, step, seed)
    share = torch.full((global_batch, 1), int(lengths.sum()) / global_batch)
    return inputs, torch.cat([labels.double(), share.double()], dim=1)


def globally_counted_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Normalised by the global batch's count of real tokens: the token losses summed over this batch, divided by
    its samples' shares of that count, so that the mean of the ranks' losses is the global token mean."""
    labels, share = targets[:, :-1].long(), targets[:, -1].float()
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total / share.sum()


def blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.lm.transformer.h)


padded_gpt2 = ModelSpec("padded_gpt2", PaddedCausalLM, padded_batch, token_mean_loss, blocks)
padded_gpt2_global = ModelSpec(
    "padded_gpt2_global", PaddedCausalLM, globally_counted_batch, globally_counted_loss, blocks
)
