"""A complete user model: a small 1-D convolutional classifier, put under the harness with
``--models suites.harness.unit.example_model:spec`` (beside or instead of the zoo's models).

The model protocol (harness/train/user_models.py) asks for four things; here they are plain
functions gathered in a `ModelSpec`. Replace the network, the batch and the loss with your own;
keep the batch a function of (global_batch, step, seed) alone, and the loss a mean over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from harness.train.models import ModelSpec, data_generator

CHANNELS, LENGTH, CLASSES = 3, 12, 5


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(1, c_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.norm(self.conv(x)))


class TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvBlock(CHANNELS, 8), ConvBlock(8, 8)])
        self.head = nn.Linear(8 * LENGTH, CLASSES)  # the root's own parameters

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def make_batch(global_batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    """The same (inputs, targets) for the same three numbers, in any process."""
    g = data_generator("example_conv", seed, step)
    x = torch.randn(global_batch, CHANNELS, LENGTH, generator=g)
    return x, (x.sum(dim=(1, 2)) > 0).long() + 2 * (x[:, 0, 0] > 0).long()  # a learnable label


spec = ModelSpec(
    name="example_conv",
    build=TinyConvNet,  # the harness seeds the global RNG before calling it
    make_batch=make_batch,
    loss=F.cross_entropy,  # a mean over the batch
    units=lambda model: list(model.blocks),  # bottom-up; the root (head) is sharded last by the harness
)
