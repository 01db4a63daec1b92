"""Full tensors of DTensor parameters, one all-gather per mesh and dtype instead of one per parameter.

``DTensor.full_tensor()`` is one collective per parameter; on a CPU box with more ranks than cores a
collective costs milliseconds of scheduling, and the harness takes the full parameters after every
step. Parameters sharded on dim 0 over a 1-D mesh (``Shard(0)``: rank r holds rows
[r x c, min((r + 1) x c, R)), c = ceil(R / W), as ``torch.chunk`` cuts) are packed, each rank's rows
padded to c, into one buffer per (mesh, dtype), gathered once and cut back. Anything else (a 2-D mesh,
another placement, a plain tensor) takes ``full_tensor()`` or is copied as it is.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor


def full_tensors(named: list[tuple[str, Tensor]], *, rank0_only: bool = False) -> dict[str, Tensor]:
    """name -> the full tensor (a new tensor), in `named`'s order. Collective: every rank of each
    parameter's mesh calls it with the same parameters. `rank0_only`: the packed parameters are gathered to
    their mesh's first rank alone (a gather: the others send and go on), and only the process group's rank 0
    gets a result; every other rank gets {}."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Tensor | None] = {}
    packs: dict = {}
    for name, p in named:
        out[name] = None
        if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.dim():
            group = p.device_mesh.get_group()
            packs.setdefault((id(group), p.dtype), (group, p.device_mesh.device_type, []))[2].append((name, p))
        elif isinstance(p, DTensor):
            out[name] = p.full_tensor().detach()
        else:
            out[name] = p.detach().clone()
    for group, device_type, items in packs.values():
        out.update(_gather_rows(group, device_type, items, rank0_only))
    return {} if rank0_only and dist.get_rank() != 0 else out


def _gather_rows(group, device_type: str, items: list, rank0_only: bool = False) -> dict[str, Tensor]:
    """The packed all-gather (`rank0_only`: gather to the group's first rank; {} elsewhere), on the mesh's device
    (shards offloaded to host memory are gathered there too)."""
    world = dist.get_world_size(group)
    rows = [-(-p.shape[0] // world) * math.prod(p.shape[1:]) for _, p in items]  # a padded chunk, elements
    first = items[0][1].to_local()
    device = first.device if first.device.type == device_type else _mesh_device(device_type)
    send = torch.zeros(sum(rows), dtype=first.dtype, device=device)
    for (_, p), part in zip(items, send.split(rows)):
        local = p.to_local().detach().reshape(-1)
        part[: local.numel()].copy_(local)
    root = dist.get_rank(group) == 0
    recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device) if root or not rank0_only else None
    with torch.no_grad():
        if rank0_only:
            chunks = list(recv.view(world, -1).unbind(0)) if root else None
            dist.gather(send, chunks, dst=dist.get_global_rank(group, 0), group=group)
            if not root:
                return {}
        else:
            # torch 2.13's name; earlier releases (a GPU box may keep one) have only all_gather_into_tensor
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(recv, send, group=group)
    return {
        name: full.reshape(-1)[: p.numel()].view(p.shape).clone()
        for (name, p), full in zip(items, recv.view(world, -1).split(rows, dim=1))
    }


def _mesh_device(device_type: str) -> torch.device:
    """The current device of a mesh's device type (cuda: the rank's GPU)."""
    module = getattr(torch, device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else None
    return torch.device(device_type, index) if index is not None else torch.device(device_type)
