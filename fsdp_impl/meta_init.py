"""Materialize a model that was built on the meta device and then sharded.

Each rank replays initialization module by module, in ``module.modules()`` order, at full size
(one module's parameters at a time), and keeps only its own slice. Eager construction runs the
same ``reset_parameters()`` calls in the same order, so with the same seed the full parameters
are bitwise identical to an eagerly built model on every rank.

Tied parameters take the value of their first owner; later owners still run their
``reset_parameters()`` so the RNG advances exactly as it did when the model was built eagerly
and tied afterwards. Modules holding meta buffers must define ``reset_buffers()``.
"""

from __future__ import annotations

import torch
from torch import nn

from .api import units


def materialize_meta(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    device = torch.device(device)
    index: dict[int, list] = {}  # id(submodule) -> [(attr name, handle, slot, first owner?)]
    for _, state in units(module):
        for h in state.handles:
            h.device = device
            _replace_shard(state.module, h, torch.zeros(h.layout.shard_numel, dtype=h.dtype, device=device))
            for slot, owners in zip(h.layout.slots, h.owners):
                for i, o in enumerate(owners):
                    index.setdefault(id(o.module), []).append((o.name, h, slot, i == 0))
    for prefix, sub in module.named_modules():
        entries = index.get(id(sub), [])
        if entries:
            _replay(prefix, sub, entries, device)
        _materialize_buffers(prefix, sub, device)
    return module


def _replace_shard(unit: nn.Module, h, value: torch.Tensor) -> None:
    """Give the handle a new shard Parameter on the real device, registered under the same name.

    (``shard.data = value`` cannot move a meta tensor to another device: set_data rejects it.)
    """
    names = [n for n, p in unit._parameters.items() if p is h.shard]
    fresh = nn.Parameter(value, requires_grad=h.requires_grad)
    fresh._fsdp_shard = True
    h.shard = fresh
    for n in names:
        unit._parameters[n] = fresh


def _replay(prefix: str, sub: nn.Module, entries, device) -> None:
    reset = getattr(sub, "reset_parameters", None)
    if reset is None:
        raise TypeError(f"module '{prefix or type(sub).__name__}' holds parameters but has no "
                        f"reset_parameters(); it cannot be initialized from the meta device")
    saved = {name: sub.__dict__.pop(name, None) for name, *_ in entries}  # views left by a forward
    for name, h, slot, _ in entries:
        sub._parameters[name] = nn.Parameter(torch.empty(slot.shape, dtype=h.dtype, device=device))
    with torch.no_grad():
        reset()
    for name, h, slot, first in entries:
        value = sub._parameters.pop(name)
        if first:
            h.load_full(slot, value)
    for name, v in saved.items():
        if v is not None:
            sub.__dict__[name] = v


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
