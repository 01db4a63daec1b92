"""Public entry points: fully_shard, set_requires_gradient_sync, full_state_dict, load_full_state_dict."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

from .handle import FlatParamHandle, Owner
from .mesh import check_hybrid_layout
from .mixed_precision import MixedPrecisionPolicy
from .state import UnitState


def fully_shard(module: nn.Module, *, process_group=None, replicate_group=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """Shard `module`'s parameters (those not already in a sharded submodule) across `process_group`.

    Apply bottom-up: each block first, then the root. Afterwards ``module.parameters()`` yields this
    rank's 1D shards (one per dtype x requires_grad group), so a stock torch.optim optimizer works
    unchanged and its state is sharded too. Gradients are averaged over the group. Returns `module`.

    Hybrid sharding (HSDP): `replicate_group` (default None: no replication) holds the ranks that
    keep the SAME shard, one per replica: the ranks at the same position in their shard groups
    (``hybrid_groups`` builds both; ``check_hybrid_layout`` refuses others, collectively). Parameters
    are gathered within `process_group` only; after backward each gradient is summed over the shard
    group, then across the replicas, and divided once: the mean over all R x S ranks.
    """
    if getattr(module, "_fsdp_state", None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed: call init_process_group first "
                           "(a world of size 1 is fine)")
    group = process_group if process_group is not None else dist.group.WORLD
    if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
        replicate_group = None  # one replica: plain sharding
    if replicate_group is not None:
        check_hybrid_layout(group, replicate_group)
    mp = mp_policy or MixedPrecisionPolicy()

    groups: dict[tuple, OrderedDict[int, tuple[nn.Parameter, list[Owner]]]] = {}
    for prefix, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is None or getattr(p, "_fsdp_shard", False):
                continue  # a sharded child's flat parameter
            fqn = f"{prefix}.{name}" if prefix else name
            if getattr(p, "_fsdp_claimed", False):
                raise ValueError(f"parameter '{fqn}' is shared with a module already passed to fully_shard; "
                                 f"tied parameters must live in one unit: shard their common ancestor instead")
            key = (p.requires_grad, p.dtype, p.device)
            groups.setdefault(key, OrderedDict()).setdefault(id(p), (p, []))[1].append(Owner(sub, name, fqn))

    handles = [FlatParamHandle(list(entries.values()), group, mp, replicate_group) for entries in groups.values()]
    for h in handles:
        for owners in h.owners:
            for o in owners:
                setattr(o.module._parameters.pop(o.name), "_fsdp_claimed", True)
    for i, h in enumerate(handles):
        module.register_parameter(f"_fsdp_flat_param{i}", h.shard)
    _broadcast_buffers(module, group)
    if replicate_group is not None:  # then every replica takes its rank 0's, which now holds rank 0's
        _broadcast_buffers(module, replicate_group)
    module._fsdp_state = UnitState(module, handles, reshard_after_forward, mp.param_dtype)
    return module


def _broadcast_buffers(module: nn.Module, group) -> None:
    """Ranks start from the same buffers (running stats, caches), as rank 0 of the group has them.
    Under HSDP it runs over the shard group, then the replicate group: all R x S ranks end with the
    buffers of the first rank of replica 0."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for b in module.buffers():
        if not b.is_meta:
            dist.broadcast(b.data, src=src, group=group)


def units(module: nn.Module):
    """(prefix, UnitState) for every sharded unit under `module`, in module order."""
    for prefix, sub in module.named_modules():
        state = getattr(sub, "_fsdp_state", None)
        if state is not None:
            yield prefix, state


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Switch the gradient reduction of every unit under `module` off (False) or back on (True), as
    FSDP2's method of the same name does. While it is off, each unit keeps its full, unreduced
    gradient between backward passes and later ones add to it; the first backward with it on reduces
    the sum once. Gradient accumulation over k micro-batches: off for the first k - 1, on for the last.
    Under HSDP both reductions (over the shard group and across replicas) are skipped while it is off."""
    for _, state in units(module):
        for h in state.handles:
            h.sync_grads = bool(requires_gradient_sync)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters under the names they had in the unwrapped module (collective over
    the shard group; under HSDP every replica gathers its own, identical, copy).

    Tied parameters appear once, under the first name, as ``named_parameters()`` gives them.
    Parameters outside any unit are included as they are.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, state in units(module):
        for h in state.handles:
            flat = h.gather_full()
            for slot in h.layout.slots:
                out[_join(prefix, slot.fqn)] = flat[slot.offset:slot.end].view(slot.shape).clone()
    for name, p in module.named_parameters():
        if not getattr(p, "_fsdp_shard", False):
            out[name] = p.detach().clone()
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full parameters (as full_state_dict returns them) into this rank's shards. No collective."""
    expected = set()
    for prefix, state in units(module):
        for h in state.handles:
            for slot in h.layout.slots:
                name = _join(prefix, slot.fqn)
                expected.add(name)
                if name not in state_dict:
                    raise KeyError(f"missing parameter '{name}' in the state dict")
                value = state_dict[name]
                if tuple(value.shape) != slot.shape:
                    raise ValueError(f"'{name}': shape {tuple(value.shape)} != expected {slot.shape}")
                h.load_full(slot, value)
    unexpected = [k for k in state_dict if k not in expected and "_fsdp_flat_param" not in k]
    plain = dict(module.named_parameters())
    unexpected = [k for k in unexpected if k not in plain]
    if unexpected:
        raise KeyError(f"unexpected parameters in the state dict: {unexpected[:5]}")
    with torch.no_grad():
        for k in state_dict:
            if k in plain and not getattr(plain[k], "_fsdp_shard", False):
                plain[k].copy_(state_dict[k])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
