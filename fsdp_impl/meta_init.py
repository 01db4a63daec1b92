"""Materialize a model that was built on the meta device and then sharded.

Each rank replays initialization module by module, in ``module.modules()`` order, at full size
(one module's parameters at a time), and keeps only its own rows of each. Eager construction runs the
same ``reset_parameters()`` calls in the same order, so with the same seed the full parameters
are bitwise identical to an eagerly built model on every rank.

Tied parameters take the value of their first owner; later owners still run their
``reset_parameters()`` so the RNG advances exactly as it did when the model was built eagerly
and tied afterwards. Modules holding meta buffers must define ``reset_buffers()``.
"""

from __future__ import annotations

import torch
from torch import nn

from .state import units


def materialize_meta(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Give every sharded parameter of `module` real storage on `device` and fill it as an eager
    build would have. Make the optimizer afterwards: the sharded parameters are new objects."""
    device = torch.device(device)
    index: dict[int, list] = {}  # id(submodule) -> [(attribute name, ShardedParam, first owner?)]
    for _, state in units(module):
        state.params.reshard()
        for p in state.params.params:
            p.replace_padded(torch.zeros(p.shard_numel, dtype=p.dtype, device=device))
            for i, o in enumerate(p.owners):
                index.setdefault(id(o.module), []).append((o.name, p, i == 0))
    for prefix, sub in module.named_modules():
        entries = index.get(id(sub), [])
        if entries:
            _replay(prefix, sub, entries, device)
        _materialize_buffers(prefix, sub, device)
    return module


def _replay(prefix: str, sub: nn.Module, entries, device) -> None:
    """Run `sub`'s reset_parameters() on full-size stand-ins, keep this rank's rows of each."""
    reset = getattr(sub, "reset_parameters", None)
    if reset is None:
        raise TypeError(
            f"module '{prefix or type(sub).__name__}' holds parameters but has no "
            f"reset_parameters(); it cannot be initialized from the meta device"
        )
    sharded = {name: sub._parameters[name] for name, *_ in entries}
    for name, p, _ in entries:
        sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device))
    try:
        with torch.no_grad():
            reset()
        for name, p, first in entries:
            if first:
                p.load_full_(sub._parameters[name])
    finally:
        sub._parameters.update(sharded)


def _materialize_buffers(prefix: str, sub: nn.Module, device) -> None:
    meta = [n for n, b in sub._buffers.items() if b is not None and b.is_meta]
    if not meta:
        return
    for n in meta:
        sub._buffers[n] = torch.empty_like(sub._buffers[n], device=device)
    reset = getattr(sub, "reset_buffers", None)
    if reset is None:
        raise TypeError(f"module '{prefix or type(sub).__name__}' has meta buffers {meta} but no reset_buffers()")
    reset()
