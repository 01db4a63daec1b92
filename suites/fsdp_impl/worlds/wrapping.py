"""fsdp_worlds tasks on what fully_shard does to a model: each rank's rows of every parameter (as
DTensors under the original names), a parameter shared across units (refused), buffers broadcast
from rank 0, nothing left alive after the model is dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_impl import fully_shard
from fsdp_impl.state import units
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import build, to_numpy


def layout(ctx, p: dict) -> dict:
    """After sharding: every unit's parameters (name, owners, global shape, the rows this rank holds
    as values, the padded shard's length and its padding values); what ``named_parameters()``
    gives (name, type, global shape, placements, mesh ranks, local shape); and the eager full
    parameters of the same seed (plain model)."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    eager = {k: to_numpy(v) for k, v in spec.build().named_parameters()}
    model, _ = build(p, ctx)
    out_units = []
    for prefix, state in units(model):
        out_units.append(
            {
                "prefix": prefix,
                "params": [
                    {
                        "fqn": q.fqn,
                        "owners": [o.fqn for o in q.owners],
                        "shape": tuple(q.shape),
                        "requires_grad": q.requires_grad,
                        "local": to_numpy(q.local()),
                        "padded_numel": q.padded.numel(),
                        "padding": to_numpy(q.padded[q.local_numel :]),
                    }
                    for q in state.params.params
                ],
            }
        )
    params = []
    for n, q in model.named_parameters():
        params.append(
            {
                "name": n,
                "type": type(q).__name__,
                "shape": tuple(q.shape),
                "placements": [repr(pl) for pl in getattr(q, "placements", ())],
                "mesh": q.device_mesh.mesh.tolist() if hasattr(q, "device_mesh") else None,
                "local_shape": tuple(q._local_tensor.shape) if hasattr(q, "_local_tensor") else None,
            }
        )
    return {
        "units": out_units,
        "eager": eager,
        "params": params,
        "tied_same_object": (model.embed.weight is model.head.weight) if p["model"] == "tinylm_tied" else None,
        "numel_local": sum(q._local_tensor.numel() for q in model.parameters()),
        "state_dict": {k: (type(v).__name__, tuple(v.shape)) for k, v in model.state_dict().items()},
    }


def shared_across_units(ctx, case: str) -> str:
    """fully_shard two units that share one Parameter; return the error text ('' if none)."""
    torch.manual_seed(0)
    root = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    root[1].weight = root[0].weight
    try:
        if case == "siblings":
            fully_shard(root[0], process_group=ctx.group)
            fully_shard(root[1], process_group=ctx.group)
        else:  # a child, then the root that still holds the other tie
            fully_shard(root[0], process_group=ctx.group)
            fully_shard(root, process_group=ctx.group)
    except ValueError as exc:
        return str(exc)
    return ""


class WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5)
        self.register_buffer("stat", torch.full((5,), float(rank) + 0.5))
        self.lin.register_buffer("inner", torch.arange(4.0) * (rank + 1))


def buffers(ctx, _: Any) -> dict:
    model = WithBuffer(ctx.rank)
    fully_shard(model.lin, process_group=ctx.group)
    fully_shard(model, process_group=ctx.group)
    return {n: to_numpy(b) for n, b in model.named_buffers()}


def released(ctx, p: dict) -> list[str]:
    """Shard, train two steps, drop model and optimizer: the names of the parameters (shards) still
    alive. A hook that holds its unit keeps every shard alive in a cycle the collector cannot see
    (tensor hooks are held from C++)."""
    import gc
    import weakref

    model, spec = build(p, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 3):
        x, y = spec.make_batch(4, step, 0)
        spec.loss(model(x), y).backward()
        opt.step()
    refs = {name: weakref.ref(q) for name, q in model.named_parameters()}
    del model, opt, x, y
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)
