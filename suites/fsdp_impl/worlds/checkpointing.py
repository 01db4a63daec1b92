"""fsdp_worlds tasks on sharded checkpoints (fsdp_impl.save_sharded / load_sharded): a run that
saves part way and trains on (the uninterrupted reference at its world size), a run that loads at
another world size and finishes, a load (or a save) that must fail with a clear message, and the
saved files a load opens.

Data is replicated (every rank trains on the global batch), so fsdp_impl's runs are bitwise the
same at every world size and a resumed run can be held to the uninterrupted one bit for bit.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.distributed.tensor import DTensor

from fsdp_impl import fully_shard, load_sharded, save_sharded
from harness.optimizers import make_optimizer
from harness.train.models import MLP, get_model_spec
from suites.fsdp_impl.worlds.common import build as build_sharded
from suites.fsdp_impl.worlds.common import local_batch, named_full, padding_max, patched
from suites.fsdp_impl.worlds.hybrid import shard_hybrid


def build(p: dict, ctx, seed: int):
    """The payload's model with `seed`: the zoo model sharded as common.build does (frozen
    parameters as asked); ``plain_tail``: only the units but the last sharded, no root unit, so the
    last layer's parameters stay whole (outside every unit); ``sizes``: an MLP of other sizes;
    ``replicas`` > 1: hybrid-sharded, R replicas of W / R ranks."""
    if "sizes" in p:
        torch.manual_seed(seed)
        model = MLP(tuple(p["sizes"]))
        for unit in model.layers:
            fully_shard(unit, process_group=ctx.group)
        return fully_shard(model, process_group=ctx.group), get_model_spec("mlp")
    if p.get("replicas", 1) > 1:  # hybrid: R replicas x W/R shards
        spec = get_model_spec(p["model"])
        torch.manual_seed(seed)
        model = spec.build()
        shard_hybrid(model, spec, ctx, p["replicas"])
        return model, spec
    if p.get("plain_tail"):
        spec = get_model_spec(p["model"])
        torch.manual_seed(seed)
        model = spec.build()
        for unit in spec.units(model)[:-1]:
            fully_shard(unit, process_group=ctx.group)
        return model, spec
    return build_sharded({**p, "seed": seed}, ctx)


def _step(model, spec, opt, p: dict, step: int, ctx) -> None:
    x, y = local_batch(spec, {**p, "seed": 0}, step, ctx)  # the data never depends on the model's seed
    spec.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def save_run(ctx, p: dict) -> dict:
    """Train ``total`` steps from seed 0 and save after step ``at`` (before any step if 0) to
    ``path``; full parameters after every step (index 0: the initial ones), on rank 0."""
    model, spec = build(p, ctx, seed=0)
    opt = make_optimizer(model.parameters(), p["optimizer"], p["lr"])
    params = [named_full(model, True)]
    for step in range(1, p["total"] + 1):
        if step - 1 == p["at"]:
            save_sharded(model, opt if p.get("with_optimizer", True) else None, p["path"])
        _step(model, spec, opt, p, step, ctx)
        params.append(named_full(model, True))
    if p["at"] == p["total"]:
        save_sharded(model, opt if p.get("with_optimizer", True) else None, p["path"])
    return {"params": params} if ctx.rank == 0 else {}


def _state_shapes_ok(model, opt) -> bool:
    """Every optimizer state value shaped like its parameter is a DTensor holding this rank's rows
    of it (the same local shape as the parameter's)."""
    for q, st in opt.state.items():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                if not isinstance(v, DTensor) or v.shape != q.shape or v._local_tensor.shape != q._local_tensor.shape:
                    return False
    return True


def load_run(ctx, p: dict) -> list[dict]:
    """For each checkpoint in ``sources`` (each saved after step ``at``): build the model from
    another seed, an optimizer with 7x the learning rate (load must restore the saved one), load,
    then train steps at+1..total. Full parameters right after load and after each step, the
    padding rows of the shards, whether the optimizer state holds this rank's rows as DTensors,
    the learning rate, and the state's keys.
    ``params_only``: load the parameters alone, into an optimizer with the right learning rate and
    no state (the negative control: a resumed run needs the optimizer's state)."""
    out = []
    for path in p["sources"]:
        model, spec = build(p, ctx, seed=1)
        params_only = p.get("params_only", False)
        opt = make_optimizer(model.parameters(), p["optimizer"], (1 if params_only else 7) * p["lr"])
        load_sharded(model, None if params_only else opt, path)
        got = {
            "loaded": named_full(model, True),
            "padding_max": padding_max(model, ctx),
            "state_shapes_ok": _state_shapes_ok(model, opt),
            "lrs": [g["lr"] for g in opt.param_groups],
            "state_keys": sorted({k for s in opt.state.values() for k in s}),
            "params": [],
        }
        for step in range(p["at"] + 1, p["total"] + 1):
            _step(model, spec, opt, p, step, ctx)
            got["params"].append(named_full(model, True))
        out.append(
            got if ctx.rank == 0 else {"padding_max": got["padding_max"], "state_shapes_ok": got["state_shapes_ok"]}
        )
    return out


def load_error(ctx, p: dict) -> dict:
    """Load ``path`` into the payload's model: the ValueError's text ('' if it loaded), and whether
    a refused load left the parameters and the optimizer as they were."""
    model, _ = build(p, ctx, seed=1)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), 0.01)
    before = [q.detach().clone() for q in model.parameters()]
    try:
        load_sharded(model, opt, p["path"])
    except ValueError as exc:
        untouched = (
            all(torch.equal(a, q) for a, q in zip(before, model.parameters()))
            and not opt.state
            and opt.param_groups[0]["lr"] == 0.01
        )
        return {"message": str(exc), "untouched": untouched}
    return {"message": "", "untouched": False}


def save_error(ctx, p: dict) -> str:
    """Save to ``path`` after one step: the ValueError's text ('' if it saved)."""
    model, spec = build(p, ctx, seed=0)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), 0.01)
    _step(model, spec, opt, p, 1, ctx)
    try:
        save_sharded(model, opt, p["path"])
    except ValueError as exc:
        return str(exc)
    return ""


def files_read(ctx, p: dict) -> list[str]:
    """The saved data files this rank opens while loading ``path`` (DCP's file streams spied on)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    opened: list[str] = []
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def spy(self, path, mode):
        opened.append(os.path.basename(str(path)))
        with real(self, path, mode) as stream:
            yield stream

    model, _ = build(p, ctx, seed=1)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), 0.01)
    with patched(FileSystem, "create_stream", spy):
        load_sharded(model, opt, p["path"])
    return sorted(f for f in set(opened) if f.endswith(".distcp"))


def dcp_round_trip(ctx, p: dict) -> dict:
    """torch.distributed.checkpoint on its own (no fsdp_impl checkpoint code): ``get_state_dict`` of
    the sharded model and its optimizer saved with ``dcp.save`` (``save``), or loaded at this world
    size with ``dcp.load`` + ``set_state_dict`` into a model of another seed (``load``); then the
    remaining steps. Full parameters after load and after each step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, spec = build(p, ctx, seed=0 if p["mode"] == "save" else 1)
    opt = make_optimizer(model.parameters(), p["optimizer"], p["lr"])
    params = []
    if p["mode"] == "save":
        for step in range(1, p["at"] + 1):
            _step(model, spec, opt, p, step, ctx)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=p["path"], process_group=ctx.group)
        params.append(named_full(model, True))
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=p["path"], process_group=ctx.group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        params.append(named_full(model, True))
    for step in range(p["at"] + 1, p["total"] + 1):
        _step(model, spec, opt, p, step, ctx)
        params.append(named_full(model, True))
    return {"params": params} if ctx.rank == 0 else {}
