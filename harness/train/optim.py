"""Optimizers by name. ``foreach=False`` everywhere: the per-parameter loop is the same code path
on plain tensors and DTensors, on CPU and CUDA, so optimizer math never differs between runs."""

from __future__ import annotations

from typing import Iterable

import torch

from harness.core.policy import ADAMW_BETAS
from harness.core.scenario import OPTIMIZERS

ADAMW_WEIGHT_DECAY = 0.01
SGD_MOMENTUM = 0.9


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """``"adamw"``: AdamW(weight_decay=0.01); ``"sgd"``: SGD(momentum=0.9)."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, foreach=False)
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
