"""The zoo's per-matrix optimizer, `normalised_sgd`, named on the command line as a user's optimizer is
(``--optimizers harness.train.optim:normalised_sgd``; harness.optimizers builds it by that name)."""

from __future__ import annotations

import torch


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
