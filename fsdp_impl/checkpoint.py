"""Sharded checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own rows;
any world size loads them back.

    save_sharded(module, optimizer, path)   # collective: every rank of the module's group calls it
    load_sharded(module, optimizer, path)   # collective, at the same, a smaller or a larger world size

Why DCP: ``module.state_dict()`` already gives every sharded parameter as a DTensor (Shard(0) over
the shard group's mesh), and the optimizer's state shaped like a parameter is a DTensor alike
(torch's optimizers make it with ``zeros_like``). DCP records each DTensor's global shape and this
rank's rows, and a load at another world size reads exactly the rows the new layout puts on each
rank (from the files that hold them, nothing gathered). What fsdp_impl adds is the optimizer state
by parameter NAME (``{"state": {fqn: {...}}, "param_groups": ...}``, so that it does not depend on
the optimizer's numbering), checks that refuse a checkpoint that does not fit in one line on every
rank, before anything changes, and a marker written last.

Files under `path`: DCP's own (``.metadata`` and one ``__<rank>_0.distcp`` per saving rank) and
``fsdp_impl.json`` (rank 0, written last, after every rank's files: a checkpoint without it is
incomplete): the format, the saving world size, every parameter's name, shape and dtype, and the
optimizer's type, parameter groups (by name) and state keys. It is what the checks read, locally,
so every rank decides alike without communicating.

The same checkpoint is an ordinary DCP checkpoint: ``dcp.load`` into ``{"model": module.state_dict()}``
of a model sharded at any world size (fsdp_impl, or FSDP2) reads the parameters.
"""

from __future__ import annotations

import io
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .state import units

FORMAT = "fsdp_impl-dcp-1"
INFO = "fsdp_impl.json"


# ------------------------------------------------------------------------------------- save


def save_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Write this rank's rows of `module`'s parameters and buffers (and of `optimizer`'s state, if
    given) under directory `path`. Collective over the module's process group; returns once every
    rank's files exist and the checkpoint is complete.

    Each step (the directory, DCP's save, then fsdp_impl.json from rank 0) ends with the ranks'
    agreement (_together: an all-gather of the outcome, a barrier too): a rank that cannot write
    makes every rank raise the same one-line ValueError, and no fsdp_impl.json is written then.
    """
    path = os.fspath(path)
    group = _checkpoint_group(module, "save_sharded")
    rank = dist.get_rank(group)
    names = _param_names(module)
    if optimizer is not None:
        _optimizer_index(module, optimizer, names, "save_sharded")
    context = f"save_sharded: cannot write the checkpoint at {path}"
    _together(group, context, lambda: _prepare(path, rank))
    _reshard(module)
    state: dict = {"model": module.state_dict()}
    if optimizer is not None:
        state["optim"] = _optimizer_state(optimizer, names)
    # values every rank holds whole (Adam's step, hyper-parameters, parameters outside every unit)
    # go to the lowest rank's file, not spread over all: a load then opens rank 0's file and the
    # files holding its own rows, not every file
    dcp = _dcp()
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    _together(group, context, lambda: dcp.save(state, checkpoint_id=path, process_group=group, planner=planner))

    def finish() -> None:
        if rank == 0:  # every rank's files exist: the checkpoint is complete once fsdp_impl.json does
            atomic_write(os.path.join(path, INFO), json.dumps(_info(module, optimizer, names, group)))

    _together(group, context, finish)


def _prepare(path: str, rank: int) -> None:
    os.makedirs(path, exist_ok=True)
    if rank == 0:  # an older save here is incomplete from now on (its marker goes first)
        try:
            os.remove(os.path.join(path, INFO))
        except FileNotFoundError:
            pass


def _optimizer_state(optimizer, names: dict[int, str]) -> dict:
    """The optimizer's state by parameter name, its groups' hyper-parameters as one bytes leaf (DCP
    keeps it whole: one value, whatever types the hyper-parameters have)."""
    state = {names[id(p)]: dict(s) for p, s in optimizer.state.items() if s}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    buffer = io.BytesIO()
    torch.save(groups, buffer)
    return {"state": state, "param_groups": buffer.getvalue()}


def _info(module, optimizer, names: dict[int, str], group) -> dict:
    params = {n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in module.named_parameters()}
    opt = None
    if optimizer is not None:
        opt = {
            "type": type(optimizer).__name__,
            "param_groups": [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups],
            "state": {names[id(p)]: sorted(s) for p, s in optimizer.state.items() if s},
        }
    return {"format": FORMAT, "world_size": dist.get_world_size(group), "params": params, "optimizer": opt}


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ------------------------------------------------------------------------------------- load


def load_sharded(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike) -> None:
    """Fill `module`'s parameters and buffers (and `optimizer`'s state and hyper-parameters, if given)
    from the checkpoint under `path`, saved at any world size. Collective over the module's group.

    First every rank checks the checkpoint against `module` and `optimizer` (locally, from
    fsdp_impl.json and DCP's metadata; the ranks then agree); then DCP reads this rank's rows into
    fresh tensors (the ranks agree again); only then does anything change. A checkpoint that does
    not fit, or that one rank cannot read, raises the same one-line ValueError on every rank and
    leaves the model and the optimizer as they were.
    """
    path = os.fspath(path)
    group = _checkpoint_group(module, "load_sharded")
    names = _param_names(module)
    context = f"load_sharded: cannot read the checkpoint at {path}"
    _reshard(module)
    target = _together(group, context, lambda: _plan_load(module, optimizer, path, names))
    _together(group, context, lambda: _dcp().load(target, checkpoint_id=path, process_group=group))
    live = module.state_dict()
    with torch.no_grad():
        for k, value in target["model"].items():
            _local(live[k]).copy_(_local(value))
    if optimizer is not None:
        _load_optimizer(optimizer, target["optim"], names)


def _plan_load(module, optimizer, path: str, names: dict[int, str]) -> dict:
    """Check the checkpoint against `module` (and `optimizer`); the tensors DCP is to fill: fresh
    ones shaped like this rank's (DTensors where the live ones are). Changes nothing."""
    info = _read_info(path)
    _check_model(info, module, path)
    _check_files(info, path)
    target = {"model": {k: torch.empty_like(v) for k, v in module.state_dict().items()}}
    if optimizer is not None:
        _optimizer_index(module, optimizer, names, "load_sharded")
        _check_optimizer(info, optimizer, names, path)
        params = {n: p for n, p in module.named_parameters()}
        metadata = _dcp().FileSystemReader(path).read_metadata().state_dict_metadata
        state = {}
        for fqn, keys in info["optimizer"]["state"].items():
            state[fqn] = {k: _state_target(metadata.get(f"optim.state.{fqn}.{k}"), params[fqn]) for k in keys}
        target["optim"] = {"state": state, "param_groups": b""}
    return target


def _state_target(meta, param: torch.Tensor):
    """What DCP fills for one optimizer state value: a DTensor like the parameter where the saved
    value has its shape (exp_avg, momentum_buffer), a plain tensor otherwise (Adam's step), None
    for a value that is not a tensor (DCP replaces it)."""
    size = getattr(meta, "size", None)
    if size is None:
        return None
    dtype = meta.properties.dtype
    if tuple(size) == tuple(param.shape) and isinstance(param, DTensor):
        return torch.empty_like(param, dtype=dtype)
    return torch.empty(tuple(size), dtype=dtype)


def _load_optimizer(optimizer, loaded: dict, names: dict[int, str]) -> None:
    """Through torch's Optimizer.load_state_dict (hyper-parameters, hooks, casts), with the saved
    state and groups numbered as this optimizer lists its parameters (_check_optimizer matched the names)."""
    saved_groups = torch.load(io.BytesIO(loaded["param_groups"]), weights_only=True)
    states, groups, index = {}, [], 0
    for group, saved in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            if name in loaded["state"]:
                states[index] = loaded["state"][name]
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": states, "param_groups": groups})


# ----------------------------------------------------------------------------------- checks


def _read_info(path: str) -> dict:
    f = os.path.join(path, INFO)
    if not os.path.exists(f):
        raise ValueError(f"load_sharded: no complete checkpoint at {path} ({INFO} is missing)")
    with open(f) as fh:
        info = json.load(fh)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"load_sharded: {f} is not an fsdp_impl checkpoint description ({FORMAT})")
    return info


def _short(items) -> str:
    items = sorted(items)
    return ", ".join(repr(i) for i in items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def _check_model(info: dict, module, path: str) -> None:
    """The same parameters (names, shapes, dtypes) as saved: else one ValueError naming the differences."""
    here = {n: [list(p.shape), str(p.dtype).removeprefix("torch.")] for n, p in module.named_parameters()}
    saved = info["params"]
    if here == saved:
        return
    only_saved, only_here = set(saved) - set(here), set(here) - set(saved)
    parts = []
    if only_saved or only_here:
        parts.append(
            f"only in the checkpoint: {_short(only_saved) or 'none'}; only here: {_short(only_here) or 'none'}"
        )
    for n in here:  # the first in the model's order
        if n in saved and saved[n] != here[n]:
            parts.append(
                f"'{n}' is {tuple(here[n][0])} {here[n][1]} here but {tuple(saved[n][0])} {saved[n][1]} "
                f"in the checkpoint"
            )
            break
    raise ValueError(
        f"load_sharded: a different model: parameters differ from the checkpoint at {path} ({'; '.join(parts)})"
    )


def _check_files(info: dict, path: str) -> None:
    """Every file DCP's metadata refers to is there: checked by every rank alike."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ValueError(f"load_sharded: the checkpoint at {path} has no DCP .metadata")
    meta = _dcp().FileSystemReader(path).read_metadata()
    files = {getattr(s, "relative_path", None) for s in (meta.storage_data or {}).values()}
    missing = [f for f in files if f and not os.path.exists(os.path.join(path, f))]
    if missing:
        raise ValueError(
            f"load_sharded: the checkpoint at {path} (saved by {info['world_size']} ranks) is missing {_short(missing)}"
        )


def _check_optimizer(info: dict, optimizer, names: dict[int, str], path: str) -> None:
    """The checkpoint holds optimizer state of the same type, in as many groups, over the same parameters."""
    saved = info["optimizer"]
    if saved is None:
        raise ValueError(
            f"load_sharded: the checkpoint at {path} holds no optimizer state "
            f"(saved with optimizer=None); pass optimizer=None to load the parameters only"
        )
    kind = type(optimizer).__name__
    if saved["type"] != kind:
        raise ValueError(
            f"load_sharded: the checkpoint at {path} holds the state of a {saved['type']} optimizer, not of a {kind}"
        )
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"load_sharded: the optimizer has {len(optimizer.param_groups)} param group(s), "
            f"the checkpoint at {path} {len(saved['param_groups'])}"
        )
    for g, (group, theirs) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        mine = [names[id(p)] for p in group["params"]]
        if sorted(mine) != sorted(theirs):
            diff = set(mine) ^ set(theirs)
            raise ValueError(
                f"load_sharded: optimizer param group {g} holds other parameters than in the "
                f"checkpoint at {path}: {_short(diff) or 'a parameter listed twice'}"
            )


# ------------------------------------------------------------------------------ agreement


def _dcp():
    """torch.distributed.checkpoint, imported at the first checkpoint: it imports torch's elastic agent and its
    planners, which a process that imports fsdp_impl to train and never checkpoints has no use for."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _together(group, context: str, fn):
    """fn() on this rank, then _agree on the outcome: fn's result, or every rank raises."""
    try:
        result, error = fn(), None
    except (Exception, _dcp().CheckpointException) as exc:  # any rank's failure is every rank's (DCP's
        # CheckpointException derives from BaseException): no rank may go on alone, or wait
        result, error = None, exc
    _agree(error, group, context)
    return result


def _agree(error: BaseException | None, group, context: str) -> None:
    """Every rank learns whether any rank failed (one all-gather: a barrier too); if one did, every
    rank raises the same one-line ValueError, the first failing rank's. Our own refusals (a
    ValueError starting with 'save_sharded:' / 'load_sharded:') keep their text; anything else
    (OSError, DCP's CheckpointException, a corrupt file) is prefixed with `context`."""
    message = None
    if error is not None:
        own = isinstance(error, ValueError) and str(error).startswith(context.split(":")[0] + ":")
        if isinstance(error, _dcp().CheckpointException) and error.failures:  # DCP: the first failing rank's error
            rank, (cause, _) = min(error.failures.items(), key=lambda kv: kv[0])
            text = f"{context}: rank {rank}: {type(cause).__name__}: {cause}"
        else:
            text = str(error) if own else f"{context}: {type(error).__name__}: {error}"
        message = " ".join(text.split())
    messages = [message]
    if dist.get_world_size(group) > 1:
        messages = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, message, group=group)
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise ValueError(first) from error


# -------------------------------------------------------------------------------- helpers


def _checkpoint_group(module: nn.Module, who: str):
    """The group every rank holding a part of `module` is in: the units' shard group, or under HSDP
    the whole job (the replicas write the same rows; DCP keeps one copy)."""
    group, hybrid = None, False
    for prefix, state in units(module):
        if not state.params.params:
            continue
        hybrid = hybrid or state.params.replicate_group is not None
        if group is None:
            group = state.params.group
        elif state.params.group is not group:
            raise ValueError(
                f"{who}: unit '{prefix}' uses another process group than the first unit; "
                f"one group per model is supported"
            )
    if group is None:
        raise ValueError(f"{who}: no fully_shard unit with parameters under this {type(module).__name__}")
    if hybrid:
        replicas = next(s.params.replicate_group for _, s in units(module) if s.params.replicate_group is not None)
        if dist.get_world_size(group) * dist.get_world_size(replicate_group := replicas) != dist.get_world_size():
            raise ValueError(
                f"{who}: a hybrid-sharded model over part of the job is not supported "
                f"(its {dist.get_world_size(group)} x {dist.get_world_size(replicate_group)} ranks "
                f"are not the whole job)"
            )
        return dist.group.WORLD
    return group


def _reshard(module: nn.Module) -> None:
    """Every unit's modules point at the sharded DTensors (a gathered copy mid-step would be stale)."""
    for _, state in units(module):
        state.params.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _param_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in module.named_parameters() (the original names; a tie: the first)."""
    return {id(p): n for n, p in module.named_parameters()}


def _optimizer_index(module, optimizer, names: dict[int, str], who: str) -> set:
    """The optimizer's parameters (a set, by identity); each must be a parameter of `module`."""
    held = set()
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{who}: optimizer param group {g} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of this {type(module).__name__}"
                )
            held.add(p)
    return held
