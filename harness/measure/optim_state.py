"""The optimizer state a rank holds, read from the rank process itself, laid out so that another
world size's state can be compared with it element for element (check ``ckpt_restored``).

Each rank lists, for every parameter its optimizers hold state for, every state value (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``; SGD's ``momentum_buffer``) with where its elements sit in
the whole tensor: a DTensor by its own spec (the global offset of its local part, any Shard or
Replicate placement on any mesh, hybrid meshes included), a plain tensor shaped like the rank's
part of a DTensor parameter at that part's offset, a plain tensor shaped like the whole parameter
(DDP: every rank holds everything) at offset 0, a scalar as itself. Rank 0 gathers every rank's
list into one file; the parent puts the parts back into whole tensors (harness.tables.restored_state).
The optimizers are the ones the rank holds (harness.measure.census: the adapter's and any inside
it), not what an adapter chooses to report.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # a torch without DTensor: every tensor is a plain one
    DTensor = Partial = None


def param_names(*modules) -> dict[int, str]:
    """id(parameter) -> its name in the first module that has it (the plain model first: its names)."""
    names: dict[int, str] = {}
    for module in modules:
        for name, p in module.named_parameters():
            names.setdefault(id(p), name)
    return names


def held_state(optimizers, names: dict[int, str], own: int = 1) -> dict:
    """This rank's optimizer state: {"state": {param: {key: part}}, "problems": [why a value could not
    be placed]}. A part is {"offset": global offset of its first element, "shape": the whole value's
    shape, "local": the rank's elements (CPU, its own dtype)} or {"value": a non-tensor value}.

    `optimizers[:own]` are the adapter's own: state of a parameter that is not one of the model's
    (`names`) is a problem there (it cannot be compared by name). The others are every other
    optimizer alive in the process (one inside a wrapper); from them only the state of the model's
    parameters counts, an unreachable optimizer of an earlier scenario not yet collected holds none.
    A parameter two optimizers hold state for keeps the first one's."""
    state, problems = {}, []
    for j, opt in enumerate(optimizers):
        for g, group in enumerate(getattr(opt, "param_groups", ())):
            for i, p in enumerate(group["params"]):
                held = getattr(opt, "state", {}).get(p)
                if not held or (id(p) not in names and j >= own):
                    continue
                name = names.get(id(p))
                if name is None:
                    problems.append(
                        f"parameter {i} of group {g} of the optimizer, shape {tuple(p.shape)}, is not "
                        f"a parameter of the model: its state cannot be compared by name"
                    )
                    continue
                if name in state:
                    continue
                parts = {}
                for key, value in held.items():
                    part = _part(p, value)
                    if isinstance(part, str):
                        problems.append(f"{name} {key}: {part}")
                    else:
                        parts[str(key)] = part
                state[name] = parts
    return {"state": state, "problems": problems}


def _part(p: torch.Tensor, value) -> dict | str:
    """Where one state value's elements sit in the whole value; a string says why that is unknown."""
    if not isinstance(value, torch.Tensor):  # as itself where a weights-only load reads it back, else as text
        return {"value": value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)}
    if DTensor is not None and isinstance(value, DTensor):
        if any(isinstance(pl, Partial) for pl in value.placements):
            return f"a DTensor with placements {value.placements}: partial sums, not elements"
        shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        local = value.to_local()
        if tuple(local.shape) != tuple(shape):
            return f"its local part is {tuple(local.shape)} where its spec gives {tuple(shape)}"
        return _placed(local, offset, value.shape)
    if value.dim() == 0:
        return _placed(value, (), ())
    if (
        DTensor is not None
        and isinstance(p, DTensor)
        and value.shape == p.to_local().shape
        and not any(isinstance(pl, Partial) for pl in p.placements)
    ):
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return _placed(value, offset, p.shape)
    if value.shape == p.shape:
        return _placed(value, (0,) * value.dim(), p.shape)
    return (
        f"a plain tensor of shape {tuple(value.shape)}: neither the parameter's {tuple(p.shape)} nor "
        f"this rank's part of it"
    )


def _placed(local: torch.Tensor, offset, shape) -> dict:
    return {
        "offset": tuple(int(o) for o in offset),
        "shape": tuple(int(s) for s in shape),
        "local": local.detach().to("cpu").clone(),
    }


def whole_state(state: dict) -> dict:
    """held_state's form of an adapter's optimizer_state ({name: {key: whole tensor or scalar}}): every value
    whole, at offset 0, as DDP's ranks hold theirs."""
    out = {}
    for name, held in state.items():
        out[name] = {
            str(key): _placed(v, (0,) * v.dim(), v.shape) if isinstance(v, torch.Tensor) else {"value": v}
            for key, v in held.items()
        }
    return {"state": out, "problems": []}


def save_held_state(optimizers, names: dict[int, str], ctx, path: Path, own: int = 1, whole=None) -> None:
    """Collective over ctx.group: rank 0 writes every rank's held_state (or `whole`, the adapter's
    optimizer_state, where it reads an engine's partitions), a list in rank order."""
    mine = held_state(optimizers, names, own) if whole is None else whole_state(whole)
    every = [mine]
    if ctx.world_size > 1:
        every = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, every, dst=dist.get_global_rank(ctx.group, 0), group=ctx.group)
    if ctx.rank == 0:
        tmp = path.with_name(path.name + ".tmp")
        torch.save(every, tmp)
        tmp.replace(path)
