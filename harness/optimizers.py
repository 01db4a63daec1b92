"""The optimizers a scenario names: the built-in ``adamw`` and ``sgd``, and a user's factory
``package.module:factory`` (``--optimizers``).

``foreach=False`` for the built-in ones: the per-parameter loop is the same code path on plain tensors and
DTensors, on CPU and CUDA, so optimizer math never differs between runs.

The user's optimizer protocol: the named object is a callable ``factory(params, lr=lr)`` that returns a
``torch.optim.Optimizer`` over ``params`` (a list of the wrapped model's parameters: plain tensors for the
plain model and DDP, DTensors for fsdp_impl and FSDP2). Every run of a scenario calls it, the plain
reference on its plain model and each adapter through ``make_optimizer(wrapped, name=..., lr=...)``, so
a per-matrix optimizer (whose update depends on the whole matrix: a norm, an orthogonalisation) is held
to what it does on the whole, unsharded matrix. `harness.train.optim:normalised_sgd` is an example.
`load_user_optimizer` (at parse time) and `check_optimizer` (preflight, before any world starts) turn
every problem into one `OptimizerError` line: a usage error, never a failure per scenario.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from harness.core.loading import one_line, resolve
from harness.core.policy import ADAMW_BETAS
from harness.core.scenario import OPTIMIZERS, user_optimizer

if TYPE_CHECKING:  # torch loads once an optimizer is built: naming one on the command line needs none
    import torch

ADAMW_WEIGHT_DECAY = 0.01
SGD_MOMENTUM = 0.9


def make_optimizer(params: Iterable[torch.nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """``"adamw"``: AdamW(weight_decay=0.01); ``"sgd"``: SGD(momentum=0.9); ``"package.module:factory"``:
    ``factory(params, lr=lr)``, held to return a ``torch.optim.Optimizer`` (OptimizerError, one line)."""
    import torch

    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, weight_decay=ADAMW_WEIGHT_DECAY, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, foreach=False)
    if user_optimizer(name):
        return build_user_optimizer(name, params, lr)
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}, or 'package.module:factory'")


class OptimizerError(ValueError):
    """A user optimizer cannot be found, imported or used; the message is one line."""


def load_user_optimizer(name: str):
    """The factory ``"package.module:factory"`` names; OptimizerError (one line) on any problem."""
    obj, attr = resolve(name, "optimizer", OptimizerError)
    if not callable(obj):
        raise OptimizerError(
            f"optimizer {name!r}: {attr} is a {type(obj).__name__}, not a callable factory(params, lr=lr)"
        )
    return obj


def build_user_optimizer(name: str, params: list, lr: float):
    """``factory(params, lr=lr)``, held to return a torch.optim.Optimizer; OptimizerError (one line) if not."""
    import torch

    factory = load_user_optimizer(name)
    try:
        opt = factory(params, lr=lr)
    except Exception as exc:  # the user's code may raise anything
        raise OptimizerError(f"optimizer {name!r}: factory(params, lr={lr:g}) raised {one_line(exc)}") from exc
    if not isinstance(opt, torch.optim.Optimizer):
        raise OptimizerError(
            f"optimizer {name!r}: factory(params, lr={lr:g}) returned {type(opt).__name__}, not a torch.optim.Optimizer"
        )
    return opt


def check_optimizer(name: str, lr: float) -> None:
    """The protocol held once, in the parent, before any world starts: the factory builds an Optimizer over
    one probe parameter, which then steps once on a gradient. OptimizerError (one line) names the problem."""
    import torch

    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = build_user_optimizer(name, [p], lr)
    p.grad = torch.full_like(p, 0.5)
    try:
        opt.step()
        opt.zero_grad(set_to_none=True)
    except Exception as exc:  # the user's code may raise anything
        raise OptimizerError(f"optimizer {name!r}: step() raised {one_line(exc)}") from exc
