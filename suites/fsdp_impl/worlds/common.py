"""What every fsdp_worlds task shares: the seeded model, sharded by fsdp_impl unless asked not
to be, this rank's batch, full parameters and gradients as numpy arrays, and the worst value in
the padding rows of the sharded parameters.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fsdp_impl import MixedPrecisionPolicy, full_state_dict, fully_shard
from fsdp_impl.state import units
from harness.train.models import get_model_spec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, None: None}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


def named_full(model: nn.Module, wrapped: bool) -> dict[str, np.ndarray]:
    """Full parameters by unwrapped name: fsdp_impl's full_state_dict, or the plain model's own."""
    params = full_state_dict(model) if wrapped else dict(model.named_parameters())
    return {k: to_numpy(v) for k, v in params.items()}


def shard_model(
    model: nn.Module,
    unit_list: list[nn.Module],
    group,
    *,
    reshard: bool = True,
    mp: dict | None = None,
    dim1: bool = False,
) -> nn.Module:
    """fully_shard on each unit, then the root; `dim1`: Shard(1) wherever dim 1 divides over the group."""
    from harness.train.features import dim1_placement

    place = dim1_placement(torch.distributed.get_world_size(group)) if dim1 else None
    policy = None
    if mp is not None:
        policy = MixedPrecisionPolicy(
            param_dtype=DTYPES[mp.get("param_dtype")], reduce_dtype=DTYPES[mp.get("reduce_dtype")]
        )
    for unit in unit_list:
        fully_shard(
            unit, process_group=group, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=place
        )
    return fully_shard(
        model, process_group=group, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=place
    )


def build(p: dict, ctx) -> tuple[nn.Module, Any]:
    """Seeded model (frozen parameters as asked), sharded unless ``wrap`` is False."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    for name in p.get("frozen", ()):
        model.get_parameter(name).requires_grad_(False)
    if p.get("wrap", True):
        units_ = spec.units(model) if p.get("units", True) else []
        shard_model(model, units_, ctx.group, reshard=p.get("reshard", True), mp=p.get("mp"), dim1=p.get("dim1", False))
    return model, spec


def padding_max(model: nn.Module, ctx=None) -> float:
    """max |value| over the padding rows of every sharded parameter's padded shard: the rows after
    this rank's own, up to the chunk every rank sends to the all-gather. Nothing but fully_shard
    writes them (zeros); the gathers send them and the copy-out drops them."""
    worst = 0.0
    for _, state in units(model):
        for p in state.params.params:
            tail = p.padded[p.local_numel :]
            if tail.numel():
                worst = max(worst, float(tail.detach().abs().max()))
    return worst


def full_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Every sharded gradient gathered to its full shape (collective, over each unit's shard group),
    by the unwrapped names; unit parameters with no gradient are left out."""
    out = {}
    for prefix, state in units(model):
        for p in state.params.params:
            g = p.sharded.grad
            if g is None:
                continue
            local = g._local_tensor.reshape(-1)
            padded = torch.zeros(p.shard_numel, dtype=local.dtype)
            padded[: local.numel()] = local
            full = torch.empty(p.world_size * p.shard_numel, dtype=local.dtype)
            dist.all_gather_into_tensor(full, padded, group=state.params.group)
            out[f"{prefix}.{p.fqn}" if prefix else p.fqn] = to_numpy(full[: p.shape.numel()].view(p.shape))
    return out


def local_batch(spec, p: dict, step: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = spec.make_batch(p.get("batch", 8), step, p.get("seed", 0))
    if p.get("data_mode", "replicated") == "split" and p.get("wrap", True):
        x, y = x[ctx.rank :: ctx.world_size], y[ctx.rank :: ctx.world_size]
    return x, y


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def shard_each_child(model: nn.Module, ctx, impl: str) -> nn.Module:
    """`model`'s children each a unit, then the root, sharded over the rank's world by FSDP2 ("fsdp2") or
    fsdp_impl (anything else): the two-unit layouts the adapters' gathers and state readers are tested on."""
    if impl == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard as fsdp2_shard

        mesh = DeviceMesh.from_group(ctx.group, "cpu")
        for unit in model:
            fsdp2_shard(unit, mesh=mesh)
        fsdp2_shard(model, mesh=mesh)
    else:
        for unit in model:
            fully_shard(unit, process_group=ctx.group)
        fully_shard(model, process_group=ctx.group)
    return model


def plain_runs(world, task: str):
    """run(payload) -> rank 0's result of `task` training the PLAIN model at world size 1 (cached per payload)."""
    cache: dict[str, dict] = {}

    def run(payload: dict) -> dict:
        key = json.dumps(payload, sort_keys=True)
        if key not in cache:
            cache[key] = world(1).call(task, {**payload, "wrap": False})[0]
        return cache[key]

    return run
