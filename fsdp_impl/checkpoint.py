"""Sharded checkpoints: every rank saves its own shards; any world size loads them back.

    save_sharded(module, optimizer, path)   # collective: every rank of the module's group calls it
    load_sharded(module, optimizer, path)   # collective, at the same, a smaller or a larger world size

Why it reshards: a flat layout's slot offsets depend only on the parameter shapes (alignment),
never on the world size; only the shard boundaries and the tail padding do. So the unpadded flat
coordinates [0, used_numel) of a handle mean the same at every world size, and a rank rebuilds its
new range [lo, hi) from the saved shards that overlap it (saved rank r held [r*s, (r+1)*s), s =
ceil(used_numel / W_saved)). Optimizer state shaped like the shard (exp_avg, exp_avg_sq,
momentum_buffer) is cut and rebuilt the same way; 0-dim and non-tensor state (Adam's step) is
copied; the param_groups' hyper-parameters are restored as Optimizer.load_state_dict does.
Parameters outside every unit are whole on every rank: rank 0 saves them (and their state) whole.

Files under `path` (format in checkpoint_format.py): one ``shard-RRRRR-of-WWWWW.pt`` per saved
rank, ``plain.pt`` when there are parameters outside every unit, and ``meta.pt`` (rank 0), written
last: a checkpoint without meta.pt is incomplete. Every file is written under a temporary name
and renamed, and carries the save's id, so a crash never leaves a file that looks complete and
files of two saves are never mixed. Nothing is gathered: a rank holds its own shards only, and
at load reads (memory-mapped) only the saved files that overlap its range. The one collective of a
load is the ranks' agreement that every rank read its part: a refusal is every rank's.
"""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
from torch import nn

from . import checkpoint_format as fmt
from .api import units


def save_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Write this rank's shards of `module` (and of `optimizer`'s state, if given) under directory
    `path`. Collective over the module's process group; returns once every rank's files exist.

    Each step (the directory, every rank's files, then meta.pt from rank 0) ends with the ranks'
    agreement (_together: an all-gather of the outcome, a barrier too): a rank that cannot write
    makes every rank raise the same one-line ValueError, and no meta.pt is written then.
    """
    path = os.fspath(path)
    handles, group = _handles(module, "save_sharded")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names = _param_names(module)
    held = _optimizer_index(module, optimizer, names, "save_sharded") if optimizer is not None else set()
    save_id = _broadcast_id(group)
    context = f"save_sharded: cannot write the checkpoint at {path}"
    _together(group, context, lambda: _prepare(path, rank))
    shard_file, plain = _together(group, context, lambda: _write(module, optimizer, path, handles, held, save_id))

    def finish() -> None:
        if rank == 0:  # every rank's files exist: the checkpoint is complete once meta.pt does
            fmt.atomic_save(fmt.meta_file(save_id, world, shard_file, plain, optimizer, names),
                            os.path.join(path, fmt.META))

    _together(group, context, finish)


def _prepare(path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    if rank == 0:  # an older save here is incomplete from now on (its meta.pt goes first)
        fmt.remove_if_present(os.path.join(path, fmt.META))


def _write(module, optimizer, path: str, handles: list, held: set, save_id: str) -> tuple[dict, list]:
    """This rank's shard file (and, on rank 0, plain.pt): (the shard file's content, the
    parameters outside every unit)."""
    h0 = handles[0][3]
    rank, world = h0.rank, h0.world_size
    shard_file = {"format": fmt.FORMAT, "save_id": save_id, "world_size": world, "rank": rank, "handles": {}}
    for name, prefix, index, h in handles:
        state = optimizer.state.get(h.shard, {}) if h.shard in held else None  # None: not in the optimizer
        shard_file["handles"][name] = fmt.shard_entry(prefix, index, h, name, state)
    fmt.atomic_save(shard_file, os.path.join(path, fmt.shard_name(rank, world)))
    plain = [(n, p) for n, p in module.named_parameters() if not getattr(p, "_fsdp_shard", False)]
    if rank == 0 and plain:
        fmt.atomic_save(fmt.plain_file(save_id, plain, optimizer, held), os.path.join(path, fmt.PLAIN))
    return shard_file, plain


def load_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Fill `module`'s shards (and `optimizer`'s state and hyper-parameters, if given) from the
    checkpoint under `path`, saved at any world size. Collective over the module's process group.

    Every rank first reads what it needs (checks, then its pieces of the overlapping saved files);
    the ranks then agree (one all-gather of their outcome) and only then does anything change. A
    checkpoint that does not fit, or that one rank cannot read, raises the same one-line ValueError
    on every rank and leaves the model and the optimizer as they were.
    """
    path = os.fspath(path)
    handles, group = _handles(module, "load_sharded")
    names = _param_names(module)
    values, state, plain = _together(group, f"load_sharded: cannot read the checkpoint at {path}",
                                     lambda: _read(module, optimizer, path, handles, names))
    params = dict(module.named_parameters())
    with torch.no_grad():
        for (_, _, _, h), value in zip(handles, values):
            h.reshard()  # a gathered copy (mid-step) would be stale: the next forward gathers anew
            h.shard.copy_(value)
        for n, value in plain["params"].items():
            params[n].copy_(value)
    if optimizer is not None:
        _load_optimizer(optimizer, state, names)


def _read(module, optimizer, path: str, handles: list, names: dict[int, str]):
    """Check the checkpoint against `module` (and `optimizer`), and read this rank's part of it:
    (the new shard of every handle, in order; the optimizer's state and saved param groups, or
    None; the parameters outside every unit and their state). Changes nothing."""
    meta = fmt.read_meta(path)
    fmt.check_layout(meta, handles, module, path)
    if optimizer is not None:
        _optimizer_index(module, optimizer, names, "load_sharded")
        fmt.check_optimizer(meta, optimizer, names, path)
    fmt.check_files_exist(meta, path)
    reader = fmt.ShardReader(path, meta)
    saved = {h["name"]: h for u in meta["units"] for h in u["handles"]}
    values, state = [], {}
    for name, _, _, h in handles:
        value, opt_state = reader.rebuild(saved[name], h, want_state=optimizer is not None)
        values.append(value)
        if opt_state is not None:
            state[name] = opt_state
    plain = reader.plain()
    state.update(plain["state"])
    reader.close()
    return values, (None if optimizer is None else (state, meta["optimizer"])), plain


def _together(group, context: str, fn):
    """fn() on this rank, then _agree on the outcome: fn's result, or every rank raises."""
    try:
        result, error = fn(), None
    except Exception as exc:  # any rank's failure is every rank's: no rank may go on alone (or wait)
        result, error = None, exc
    _agree(error, group, context)
    return result


def _agree(error: Exception | None, group, context: str) -> None:
    """Every rank learns whether any rank failed (one all-gather: a barrier too); if one did, every
    rank raises the same one-line ValueError, the first failing rank's. Our own refusals (a
    ValueError starting with 'save_sharded:' / 'load_sharded:') keep their text; anything else
    (OSError, a corrupt file) is prefixed with `context`."""
    message = None
    if error is not None:
        own = isinstance(error, ValueError) and str(error).startswith(context.split(":")[0] + ":")
        message = " ".join((str(error) if own else f"{context}: {type(error).__name__}: {error}").split())
    messages = [message]
    if dist.get_world_size(group) > 1:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise ValueError(first) from error


# -------------------------------------------------------------------------------- helpers

def _handles(module: nn.Module, who: str) -> tuple[list[tuple[str, str, int, object]], object]:
    """(parameter name of the shard, unit prefix, handle index, handle) for every handle, and the
    one process group they share."""
    out, group = [], None
    for prefix, state in units(module):
        for i, h in enumerate(state.handles):
            name = f"{prefix}._fsdp_flat_param{i}" if prefix else f"_fsdp_flat_param{i}"
            out.append((name, prefix, i, h))
            if getattr(h, "replicate_group", None) is not None:
                raise ValueError(f"{who}: unit '{prefix}' is hybrid-sharded (a replicate group); sharded "
                                 f"checkpoints of hybrid meshes are not supported yet")
            if group is None:
                group = h.group
            elif h.group is not group:
                raise ValueError(f"{who}: unit '{prefix}' uses another process group than the first unit; "
                                 f"one group per model is supported")
    if group is None:
        raise ValueError(f"{who}: no fully_shard unit with parameters under this {type(module).__name__}")
    return out, group


def _param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in module.named_parameters() (a shard: '<unit>._fsdp_flat_param<i>')."""
    return {id(p): n for n, p in module.named_parameters()}


def _optimizer_index(module, optimizer, names: dict[int, str], who: str) -> set:
    """The optimizer's parameters (a set, by identity); each must be a parameter of `module`."""
    held = set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"{who}: optimizer param group {g} holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of this {type(module).__name__}")
            held.add(p)
    return held


def _load_optimizer(optimizer, read: tuple[dict[str, dict], dict], names: dict[int, str]) -> None:
    """Through torch's Optimizer.load_state_dict (hyper-parameters, hooks, casts), with the saved
    groups' parameters numbered as this optimizer lists them (check_optimizer matched the names)."""
    state, saved = read
    groups, states, index = [], {}, 0
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            if name in state:
                states[index] = state[name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": states, "param_groups": groups})


def _broadcast_id(group) -> str:
    """A fresh id chosen by rank 0 of the group, the same on every rank."""
    box = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]
