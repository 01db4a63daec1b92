"""User models written for the tests of non-finite training (`finite`, harness/train/nonfinite.py): each gives a
NaN or an Inf in one known place, at one known step, and is otherwise an ordinary model that trains.

- `nan_in_middle`: module `mid.gate` multiplies by NaN, so `mid.gate`'s output is the first non-finite, at step 1
  (its sibling `mid.proj` before it stays finite; `mid`, `head` and the model after it are non-finite too);
- `inf_input_at_step_3`: the batch of step 3 holds an Inf, so module `first` gives the first non-finite output,
  at step 3 (steps 1 and 2 train normally);
- `nan_target_at_step_2`: every output finite, the targets of step 2 hold a NaN: the loss alone is non-finite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.models import ModelSpec, data_generator

FEATURES, HIDDEN, OUT = 6, 8, 3


class Gate(nn.Module):
    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(HIDDEN))
        self.poison = poison

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.scale
        return out * float("nan") if self.poison else out


class Middle(nn.Module):
    def __init__(self, poison: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.gate = Gate(poison)

    def forward(self, x: Tensor) -> Tensor:
        return self.gate(torch.tanh(self.proj(x)))


class Net(nn.Module):
    def __init__(self, poison: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(FEATURES, HIDDEN)
        self.mid = Middle(poison)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mid(torch.relu(self.first(x))))


def _batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    g = data_generator("nonfinite_models", seed, step)
    x = torch.randn(global_batch, FEATURES, generator=g)
    return x, torch.randn(global_batch, OUT, generator=g)


def _inf_at_step_3(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    x, y = _batch(global_batch, step, seed)
    if step == 3:
        x[0, 0] = float("inf")
    return x, y


def _nan_target_at_step_2(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    x, y = _batch(global_batch, step, seed)
    if step == 2:
        y[0, 0] = float("nan")
    return x, y


def _units(model: Net) -> list[nn.Module]:
    return [model.first, model.mid, model.head]


nan_in_middle = ModelSpec("nan_in_middle", lambda: Net(poison=True), _batch, F.mse_loss, _units)
inf_input_at_step_3 = ModelSpec("inf_input_at_step_3", Net, _inf_at_step_3, F.mse_loss, _units)
nan_target_at_step_2 = ModelSpec("nan_target_at_step_2", Net, _nan_target_at_step_2, F.mse_loss, _units)
