"""Ordinary models of the kind a user brings, written for the tests of the harness's verdicts on them (not the zoo's):
a small 2-D conv net whose head has an uneven row count, an MLP with dropout, and a language model whose loss is a
mean over its non-pad tokens. Each is a `ModelSpec` named ``suites.harness.unit.ordinary_models:<name>``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.models import ModelSpec, data_generator


class ConvUnit(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.conv(x))


class SmallConvNet(nn.Module):
    """Two conv units and a 490-to-7 linear head: 7 rows, which 2, 4 and 8 ranks do not divide."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList([ConvUnit(1, 6), ConvUnit(6, 10)])
        self.head = nn.Linear(10 * 7 * 7, 7)

    def forward(self, x: Tensor) -> Tensor:
        for unit in self.units:
            x = unit(x)
        return self.head(x.flatten(1))


def _images(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    g = data_generator("ordinary_conv", seed, step)
    x = torch.randn(global_batch, 1, 7, 7, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) * 7).long().clamp(-3, 3) + 3


conv_net = ModelSpec("conv_net", SmallConvNet, _images, F.cross_entropy, lambda m: list(m.units))
