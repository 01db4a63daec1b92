"""Optimizers by name: the built-in ``adamw`` and ``sgd``, a user's factory ``package.module:factory``
(harness/train/user_optim.py), and the zoo's per-matrix optimizer `normalised_sgd`.

``foreach=False`` everywhere: the per-parameter loop is the same code path on plain tensors and
DTensors, on CPU and CUDA, so optimizer math never differs between runs."""

from __future__ import annotations

from typing import Iterable

import torch

from harness.core.policy import ADAMW_BETAS
from harness.core.scenario import OPTIMIZERS, user_optimizer

ADAMW_WEIGHT_DECAY = 0.01
SGD_MOMENTUM = 0.9


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """``"adamw"``: AdamW(weight_decay=0.01); ``"sgd"``: SGD(momentum=0.9); ``"package.module:factory"``:
    ``factory(params, lr=lr)``, held to return a ``torch.optim.Optimizer`` (OptimizerError, one line)."""
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, foreach=False)
    if user_optimizer(name):
        from harness.train.user_optim import build_user_optimizer

        return build_user_optimizer(name, params, lr)
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}, or 'package.module:factory'")


class NormalisedSGD(torch.optim.Optimizer):
    """Normalised SGD, a per-matrix optimizer: each parameter tensor steps by ``-lr * g / ||g||_F``, the
    Frobenius norm of its WHOLE gradient (no state). Written with plain torch ops on the parameter and
    its gradient, so that on DTensors (fsdp_impl, FSDP2) ``g.square().sum()`` is the partial sum of the
    rank's shard and the ``sqrt`` that follows reduces it over the mesh first: the norm is the whole
    matrix's on every rank. Applying it to a shard alone (its own norm) is the bug class of DeepSpeed
    #7807 (mutant ``shard_normalised`` in suites/mutants/). A zero gradient leaves the parameter as it is
    (the norm is clamped to the smallest normal float, which no non-zero norm falls below in practice)."""

    def __init__(self, params, lr: float) -> None:
        if lr <= 0:
            raise ValueError(f"lr must be positive, got {lr}")
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                norm = g.square().sum().sqrt().clamp_min(torch.finfo(g.dtype).tiny)
                p.sub_(g / norm * group["lr"])
        return loss


def normalised_sgd(params, lr: float) -> torch.optim.Optimizer:
    """The zoo's per-matrix optimizer, by name ``harness.train.optim:normalised_sgd`` (NormalisedSGD)."""
    return NormalisedSGD(params, lr=lr)
