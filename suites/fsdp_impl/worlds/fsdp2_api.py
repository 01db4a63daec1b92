"""fsdp_worlds tasks for fsdp_impl as a drop-in for FSDP2's public API: code written for
``torch.distributed.fsdp.fully_shard`` run with fsdp_impl's ``fully_shard`` swapped in, against fsdp_impl
called its own way (process groups, package functions).

- ``adapter_run``: the harness's own FSDP2 adapter (harness/adapters/torch_fsdp2.py) with fsdp_impl's
  fully_shard in place of FSDP2's, or the fsdp_impl adapter, through the harness's wrap for a feature;
- ``loop``: a training loop as an FSDP2 user writes it (``fully_shard(block, mesh=mesh)``, the module's
  ``set_requires_gradient_sync``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``), on fsdp_impl
  or on FSDP2 itself, or the same steps fsdp_impl's own way;
- ``methods``: FSDP2's module methods on fsdp_impl's units, each against the run without it;
- ``errors``: the refusals, as text.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_impl
import fsdp_impl.group as fsdp_group
from fsdp_impl.param import ShardState
from fsdp_impl.state import units
from harness.adapters.fsdp_impl import FsdpImplAdapter
from harness.adapters.torch_fsdp2 import TorchFSDP2Adapter
from harness.optimizers import make_optimizer
from harness.train.features import wrap_for
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import local_batch, named_full, patched
from suites.fsdp_impl.worlds.hybrid import groups as hybrid_groups

_MESHES: dict[tuple, object] = {}  # (world size, shape) -> this rank's DeviceMesh, made once per worker


def device_mesh(ctx, shape: tuple[int, ...]):
    """init_device_mesh("cpu", shape), FSDP2's (replicate, shard) names for 2-D; made once and kept."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (ctx.world_size, tuple(shape))
    if key not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else ("dp",) if len(shape) == 1 else None
        _MESHES[key] = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return _MESHES[key]


@contextlib.contextmanager
def fsdp_impl_as_fsdp2():
    """``torch.distributed.fsdp.fully_shard`` is fsdp_impl's while inside (code that imports it by name at
    call time, as the FSDP2 adapter does, gets fsdp_impl's)."""
    import torch.distributed.fsdp as torch_fsdp

    with patched(torch_fsdp, "fully_shard", fsdp_impl.fully_shard):
        yield


def _norm(total) -> float:
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


# -------------------------------------------------------------------------------------- tasks


def adapter_run(ctx, p: dict) -> dict:
    """``steps`` steps through an adapter (``impl``: "fsdp_impl", or "fsdp2_code": the FSDP2 adapter with
    fsdp_impl's fully_shard) wrapped for ``feature``: two micro-batches per step (the adapter's gradient
    sync off for the first), the adapter's clipping at ``max_norm`` / ``norm_type``, AdamW. Returns the
    losses, norms and full parameters after every step, and the wrapped module's class."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    swap = fsdp_impl_as_fsdp2() if p["impl"] == "fsdp2_code" else contextlib.nullcontext()
    adapter = TorchFSDP2Adapter() if p["impl"] == "fsdp2_code" else FsdpImplAdapter()
    with swap:
        wrapped = wrap_for(p.get("feature", "plain"), adapter, model, spec.units(model), ctx=ctx)
        opt = make_optimizer(wrapped.parameters(), "adamw", 0.01)
        out = {
            "losses": [],
            "norms": [],
            "params": [],
            "cls": type(wrapped).__name__,
            "is_unit": isinstance(wrapped, fsdp_impl.FSDPModule),
        }
        for step in range(1, p.get("steps", 3) + 1):
            x, y = local_batch(spec, p, step, ctx)
            for j, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                adapter.set_gradient_sync(wrapped, j == 1)
                loss = spec.loss(wrapped(xm), ym) / 2
                loss.backward()
            out["norms"].append(adapter.clip_grad_norm(wrapped, p["max_norm"], p["norm_type"]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["losses"].append(float(loss.detach()))
            out["params"].append(named_full(wrapped, True))
    return out


def loop(ctx, p: dict) -> dict:
    """Training as an FSDP2 user writes it (``way``: "fsdp2_code" with fsdp_impl's fully_shard, "fsdp2":
    the same code on FSDP2 itself), or the same steps fsdp_impl's own way (``way``: "own": process groups,
    ``hybrid_groups``, the package's set_requires_gradient_sync; ``clip``: "fsdp_impl" for its
    clip_grad_norm_, else torch's). ``mesh``: the mesh's shape ([W] or [R, S]). Two micro-batches a step,
    AdamW. Returns the losses, norms and full parameters after every step."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    blocks = spec.units(model)
    way = p["way"]
    if way in ("fsdp2_code", "fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard = fsdp_impl.fully_shard if way == "fsdp2_code" else fully_shard
        mesh = device_mesh(ctx, tuple(p["mesh"]))
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float64)  # fsdp_impl's default: one dtype wider
        for block in blocks:
            shard(block, mesh=mesh, mp_policy=policy)
        shard(model, mesh=mesh, mp_policy=policy)  # reshard_after_forward=None: the root stays gathered

        def sync(flag):
            model.set_requires_gradient_sync(flag)
    else:
        mesh = p["mesh"]
        shard_group, rep = hybrid_groups(ctx, mesh[0]) if len(mesh) == 2 else (ctx.group, None)
        for block in blocks:
            fsdp_impl.fully_shard(block, process_group=shard_group, replicate_group=rep)
        fsdp_impl.fully_shard(model, process_group=shard_group, replicate_group=rep, reshard_after_forward=False)

        def sync(flag):
            fsdp_impl.set_requires_gradient_sync(model, flag)

    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = {"losses": [], "norms": [], "params": [], "cls": type(model).__name__}
    for step in range(1, p.get("steps", 3) + 1):
        x, y = local_batch(spec, p, step, ctx)
        for j, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
            sync(j == 1)
            loss = spec.loss(model(xm), ym) / 2
            loss.backward()
        if way == "own" and p.get("clip") == "fsdp_impl":
            total = fsdp_impl.clip_grad_norm_(model, p["max_norm"], p["norm_type"])
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), p["max_norm"], p["norm_type"])
        out["norms"].append(_norm(total))
        opt.step()
        opt.zero_grad()
        out["losses"].append(float(loss.detach()))
        out["params"].append(full_params(model, way))
    return out


def full_params(model: nn.Module, way: str) -> dict:
    if way != "fsdp2":
        return named_full(model, True)
    return {n: q.detach().full_tensor().numpy().copy() for n, q in model.named_parameters()}


def _unit_states(model: nn.Module) -> dict[str, str]:
    """unit -> SHARDED, UNSHARDED, or GATHERING (an asynchronous all-gather issued, not completed)."""
    return {
        prefix or "<root>": "GATHERING" if state.params.gathering else state.params.state.name
        for prefix, state in units(model)
    }


def sync_flags(ctx, p: dict) -> dict:
    """Each unit's gradient-sync flag (root first) after ``model.set_requires_gradient_sync(False)``, then
    after ``model.set_requires_gradient_sync(True, recurse=False)``."""
    spec = get_model_spec("tinylm")
    model = spec.build()
    for block in spec.units(model):
        fsdp_impl.fully_shard(block)
    fsdp_impl.fully_shard(model)
    model.set_requires_gradient_sync(False)
    out = {"recurse": [state.params.sync_grads for _, state in units(model)]}
    model.set_requires_gradient_sync(True, recurse=False)
    out["this_unit"] = [state.params.sync_grads for _, state in units(model)]
    return out


def methods(ctx, p: dict) -> dict:
    """Two steps of tinylm (its blocks and the root units), with ``use`` one of FSDP2's methods called as a
    training loop does (``none``: none); two micro-batches a step, gradient sync off for the first through
    the module's method. Returns the full parameters after every step, the all-gathers each step issued
    (by unit, and whether asynchronous), the unit states at chosen moments."""
    spec = get_model_spec(p.get("model", "tinylm"))
    torch.manual_seed(0)
    model = spec.build()
    blocks = spec.units(model)
    for block in blocks:
        fsdp_impl.fully_shard(block)
    fsdp_impl.fully_shard(model)
    names = {id(state.params): prefix or "<root>" for prefix, state in units(model)}
    use = p["use"]
    if use == "prefetch":  # each block prefetches the next in forward, the one before in backward
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
            block.set_modules_to_backward_prefetch(blocks[i - 1 : i] if i else [])
    gathers: list = []
    issued = fsdp_group.ParamGroup.unshard

    def spy(self, async_op=False):
        if self.state is ShardState.SHARDED and not self.gathering:
            gathers.append((names[id(self)], async_op))
        return issued(self, async_op=async_op)

    seen: dict = {}
    if use in ("prefetch", "none"):  # the units gathered as each block's forward begins (after fsdp_impl's hook)

        def look(i):
            def hook(module, args):
                seen.setdefault(f"fwd{i}", _unit_states(model))

            return hook

        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(look(i))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    out = {"params": [], "gathers": [], "seen": seen, "blocks": [names[id(b._fsdp_state.params)] for b in blocks]}
    with patched(fsdp_group.ParamGroup, "unshard", spy):
        for step in range(1, p.get("steps", 2) + 1):
            gathers.clear()
            x, y = local_batch(spec, {"batch": 8}, step, ctx)
            for j, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):
                model.set_requires_gradient_sync(j == 1)
                if use == "reshard_after_backward":
                    model.set_reshard_after_backward(j == 1)
                    model.set_is_last_backward(j == 1)
                if use == "unshard" and j == 0:
                    handle = blocks[0].unshard(async_op=True)
                    seen.setdefault("after_unshard", _unit_states(model))
                    handle.wait()
                if use == "reshard_after_forward":
                    model.set_reshard_after_forward(False)
                loss = spec.loss(model(xm), ym) / 2
                if use == "reshard_after_forward":
                    seen.setdefault("after_forward", _unit_states(model))
                loss.backward()
                if use == "reshard_after_backward":
                    seen.setdefault(f"after_backward{j}", _unit_states(model))
            if use == "unshard":  # gathered outside any forward, then given back
                blocks[1].unshard()
                seen.setdefault("unsharded", _unit_states(model))
                blocks[1].reshard()
                seen.setdefault("resharded", _unit_states(model))
            opt.step()
            opt.zero_grad()
            out["params"].append(named_full(model, True))
            out["gathers"].append(list(gathers))
    return out


def errors(ctx, p: dict) -> dict[str, str]:
    """The error text (``type: message``) of each refused form; '' where nothing was raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    mesh = device_mesh(ctx, (ctx.world_size,))
    lin = nn.Linear(4, 4)
    cases = {
        "mesh_and_process_group": lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=mesh, process_group=ctx.group),
        "mesh_and_replicate_group": lambda: fsdp_impl.fully_shard(
            nn.Linear(4, 4), mesh=mesh, replicate_group=ctx.group
        ),
        "ignored_params": lambda: fsdp_impl.fully_shard(lin, mesh=mesh, ignored_params={lin.weight}),
        "dp_mesh_dims": lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=object()),
        "module_list": lambda: fsdp_impl.fully_shard([nn.Linear(4, 4), nn.Linear(4, 4)], mesh=mesh),
        "output_dtype": lambda: fsdp_impl.fully_shard(
            nn.Linear(4, 4), mesh=mesh, mp_policy=TorchPolicy(output_dtype=torch.float32)
        ),
        "cast_forward_inputs": lambda: fsdp_impl.fully_shard(
            nn.Linear(4, 4), mesh=mesh, mp_policy=TorchPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
        ),
        "offload_policy": lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=mesh, offload_policy="cpu"),
        "mesh_3d": lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, ctx.world_size))),
        "mesh_not_a_mesh": lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=ctx.group),
    }
    if ctx.world_size == 2:  # the ranks in reverse: rank 0 at mesh position 1 (its group keeps rank order)
        from torch.distributed.device_mesh import DeviceMesh

        reverse = DeviceMesh("cpu", [1, 0])
        cases["mesh_out_of_order"] = lambda: fsdp_impl.fully_shard(nn.Linear(4, 4), mesh=reverse)
    unit = fsdp_impl.fully_shard(nn.Sequential(nn.Linear(4, 4)), mesh=mesh)
    cases["reshard_after_forward_int"] = lambda: unit.set_reshard_after_forward(2)
    cases["prefetch_not_a_unit"] = lambda: unit.set_modules_to_forward_prefetch([nn.Linear(4, 4)])
    cases["deepcopy"] = lambda: __import__("copy").deepcopy(unit)
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = ""
        except Exception as exc:  # noqa: BLE001 - the text is the result
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier(ctx.group)
    return out
