"""Deterministic data: one global batch per (step, seed), identical on every rank, then each
rank's slice of it. Split mode is DistributedSampler(shuffle=False, drop_last=False) on a batch
that divides evenly: rank r takes samples r, r + W, r + 2W, ..."""

from __future__ import annotations

import torch
from torch import Tensor

from harness.core.scenario import DATA_MODES
from harness.train.models import ModelSpec


def global_batch(spec: ModelSpec, global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets) of the whole step, on CPU; depends only on (model, size, step, seed)."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    return spec.make_batch(global_batch, step, seed)


def eval_batch(spec: ModelSpec, global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """The held-out batch evaluated after step `step` (feature eval): the model's batch of step -`step`,
    which no training step draws (training steps are 1, 2, ...); the same on every rank."""
    if step < 1:
        raise ValueError(f"an eval batch follows a training step (1, 2, ...), got step {step}")
    return spec.make_batch(global_batch, -step, seed)


def local_slice(
    inputs: Tensor, targets: Tensor, rank: int, world_size: int, mode: str
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's (inputs, targets, global_indices). ``replicated``: all samples; ``split``:
    samples rank::world_size (the batch must divide by world_size so every rank's mean loss
    weighs its samples like the full-batch mean does)."""
    if mode not in DATA_MODES:
        raise ValueError(f"unknown data mode {mode!r}; valid: {', '.join(DATA_MODES)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    n = inputs.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"inputs have {n} samples but targets have {targets.shape[0]}")
    if mode == "replicated":
        return inputs, targets, torch.arange(n)
    if n % world_size:
        raise ValueError(f"split mode needs global batch {n} divisible by world size {world_size}")
    idx = torch.arange(rank, n, world_size)
    return inputs[idx], targets[idx], idx
