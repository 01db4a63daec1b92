"""A user model written for the tests of `params_move` (harness/checks/rows.py): its first layer frozen
(requires_grad False: it never moves, in any correct run), the rest trained; an ordinary model otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.models import ModelSpec, data_generator

FEATURES, HIDDEN, CLASSES = 6, 8, 3


class HalfFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(FEATURES, HIDDEN)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(torch.relu(self.frozen(x)))))


def _batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    g = data_generator("half_frozen", seed, step)
    x = torch.randn(global_batch, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


spec = ModelSpec("half_frozen", HalfFrozen, _batch, F.cross_entropy, lambda m: [m.body, m.head])
