"""The user's own model, named ``"package.module:factory"`` on the command line (``--models``).

The model protocol: the named object is a `ModelSpec`, or any object with these four members, or a
zero-argument callable that returns one::

    build()                              -> nn.Module   plain fp32 CPU model, knows nothing of
                                                        parallelism; initialised from the global torch
                                                        RNG (the harness seeds it first)
    make_batch(global_batch, step, seed) -> (inputs, targets)  on CPU, the same for the same three
                                                        numbers on every call and in every process
                                                        (draw from harness.train.models.data_generator)
    loss(outputs, targets)               -> scalar      the MEAN over the batch (split data averages
                                                        ranks' means)
    units(model)                         -> list[nn.Module]   submodules to shard as units, bottom-up;
                                                        a tied parameter must live in one unit

`suites/unit/example_model.py` is a complete example (``--models suites.unit.example_model:spec``).
"""

from __future__ import annotations

import importlib
import inspect

MEMBERS = ("build", "make_batch", "loss", "units")


class ModelError(ValueError):
    """A user model cannot be found, imported or used; the message is one line."""


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def load_user_model(name: str):
    """The `ModelSpec` for ``"package.module:factory"``; ModelError (one line) on any problem."""
    from harness.train.models import ModelSpec

    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ModelError(f"model {name!r}: expected 'package.module:factory'")
    try:
        obj: object = importlib.import_module(module)
    except Exception as exc:  # ImportError, SyntaxError, anything its top level raises
        raise ModelError(f"model {name!r}: module {module!r} could not be imported: {_one_line(exc)}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model {name!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not _complete(obj) and callable(obj) and (inspect.isfunction(obj) or inspect.isclass(obj)):
        try:
            obj = obj()
        except Exception as exc:  # a user factory may raise anything
            raise ModelError(f"model {name!r}: calling {attr}() failed: {_one_line(exc)}") from exc
    missing = [m for m in MEMBERS if not callable(getattr(obj, m, None))]
    if missing:
        raise ModelError(f"model {name!r}: {type(obj).__name__} has no {', '.join(m + '()' for m in missing)} "
                         f"(a model needs {', '.join(MEMBERS)}; see harness/train/user_models.py)")
    return ModelSpec(name, obj.build, obj.make_batch, obj.loss, obj.units)


def _complete(obj: object) -> bool:
    return all(callable(getattr(obj, m, None)) for m in MEMBERS)


def check_built(name: str, model: object, units: object) -> None:
    """What build() and units() returned, held to the protocol: ModelError (one line) naming the problem."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r}: build() returned {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ModelError(f"model {name!r}: the model build() returned has no parameters")
    if not isinstance(units, (list, tuple)) or not all(isinstance(u, nn.Module) for u in units):
        raise ModelError(f"model {name!r}: units(model) returned {type(units).__name__}, not a list of nn.Module")
    inside = {id(m) for m in model.modules()}
    strangers = [type(u).__name__ for u in units if id(u) not in inside or u is model]
    if strangers:
        raise ModelError(f"model {name!r}: units(model) returned {', '.join(strangers)}, which are not submodules "
                         f"of the model (the root is sharded last by the harness itself)")


def check_batch(name: str, batch: object, global_batch: int) -> None:
    """What make_batch returned: two tensors of `global_batch` samples each."""
    import torch

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ModelError(f"model {name!r}: make_batch returned {type(batch).__name__}, not (inputs, targets) tensors")
    sizes = [int(t.shape[0]) if t.dim() else 0 for t in batch]
    if sizes != [global_batch, global_batch]:
        raise ModelError(f"model {name!r}: make_batch({global_batch}, ...) returned {sizes[0]} inputs and "
                         f"{sizes[1]} targets; both must hold {global_batch} samples (dim 0)")
