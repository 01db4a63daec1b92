"""Public entry points: fully_shard, set_requires_gradient_sync, full_state_dict, load_full_state_dict."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .collectives import all_gather_flat, gather_flat
from .compat import as_mp_policy, as_offload_policy, groups_from_mesh, refuse_unsupported
from .group import ParamGroup
from .mesh import check_hybrid_layout, device_for, post_forward_group
from .mixed_precision import MixedPrecisionPolicy
from .module import make_fsdp_module
from .offload import CPUOffloadPolicy
from .param import Owner, ShardedParam
from .state import UnitState, sharded_params, units


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    process_group=None,
    replicate_group=None,
    reshard_after_forward: bool | int | None = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_placement_fn=None,
    offload_policy: CPUOffloadPolicy | None = None,
    ignored_params=None,
    dp_mesh_dims=None,
) -> nn.Module:
    """Shard `module`'s parameters (those not already in a sharded submodule) across `process_group`.

    Apply bottom-up: each block first, then the root. Afterwards every parameter is, under its
    original name, an ``nn.Parameter`` holding a DTensor sharded ``Shard(0)`` over the shard
    group's DeviceMesh (this rank's rows of dim 0; a rank may hold none), so a stock torch.optim
    optimizer works unchanged, with parameter groups, and its state is sharded too; and
    ``module.state_dict()`` gives those DTensors without communication, for
    ``torch.distributed.checkpoint``. Gradients are averaged over the group. Returns `module`.

    Hybrid sharding (HSDP): `replicate_group` (default None: no replication) holds the ranks that
    keep the SAME shard, one per replica: the ranks at the same position in their shard groups
    (``hybrid_groups`` builds both; ``check_hybrid_layout`` refuses others, collectively). Parameters
    are gathered within `process_group` only; after backward each gradient is summed over the shard
    group, then across the replicas, and divided once: the mean over all R x S ranks. The DTensors
    live on the shard group's mesh: every replica holds its own copy of the same shards.

    `mesh`, FSDP2's form (compat.py), in place of the two groups: a 1-D DeviceMesh shards over its group,
    with the DTensors on that mesh; a 2-D one is FSDP2's HSDP, (replicate, shard): the shard group is its
    dim 1's, the replicate group its dim 0's (the layout above), the DTensors on the shard group's 1-D mesh.
    Giving `mesh` with `process_group` or `replicate_group` is a ValueError. Neither: the whole job.
    `mp_policy` and `offload_policy` may be FSDP2's own objects (mapped to ours; FSDP2's ``OffloadPolicy()``
    is no offload). FSDP2's `ignored_params`, `dp_mesh_dims`, a list of modules and the policy fields
    fsdp_impl has no counterpart of are refused (ValueError). The module returned is `module`, now an
    instance of ``FSDP<its class>`` with FSDP2's methods (module.py).

    `reshard_after_forward`, as FSDP2 has it: True frees the unit's gathered parameters after its forward
    (backward gathers them again), False keeps them until its backward; None (FSDP2's default) is False
    for the root unit (the one whose forward encloses the others') and True for the others; an int g
    dividing the shard group's W ranks reshards to groups of g consecutive ranks: each rank keeps 1 / g of
    the unit between forward and backward, and backward's all-gather runs within those g ranks (group.py,
    [Note: resharding to a smaller group]); g = W is True, g = 1 is False. The groups are made at the first
    use of a g with this shard group (collective: every rank of it calls fully_shard alike) and kept for
    later units.

    `shard_placement_fn(parameter) -> Shard(d) | None`, as FSDP2 has it: the dim each parameter is sharded on
    (None: 0). A dim other than 0 must divide evenly over the shard group (param.py, [Note: another shard
    dimension]); the parameter is then a DTensor ``Shard(d)``.

    `offload_policy` (a ``CPUOffloadPolicy``, as FSDP2 has it; default None): the sharded parameters, their
    gradients and so the optimizer's state live in host memory; forward and backward run on the device the
    module is on (offload.py). Apply it to every unit of a model alike.
    """
    refuse_unsupported(module, ignored_params, dp_mesh_dims)
    offload_policy, mp_policy = as_offload_policy(offload_policy), as_mp_policy(mp_policy)
    if getattr(module, "_fsdp_state", None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call init_process_group first (a world of size 1 is fine)"
        )
    dtensor_mesh = None  # made from the shard group unless a 1-D mesh was given
    if mesh is not None:
        if process_group is not None or replicate_group is not None:
            raise ValueError(
                "fully_shard: give either mesh= (FSDP2's form) or process_group= / replicate_group=, not both"
            )
        process_group, replicate_group, dtensor_mesh = groups_from_mesh(mesh)
    group = process_group if process_group is not None else dist.group.WORLD
    if replicate_group is not None and dist.get_world_size(replicate_group) == 1:
        replicate_group = None  # one replica: plain sharding
    if replicate_group is not None:
        check_hybrid_layout(group, replicate_group)
    mp = mp_policy or MixedPrecisionPolicy()
    reshard_after_forward, post_forward = _post_forward(reshard_after_forward, group)

    entries: OrderedDict[int, tuple[nn.Parameter, list[Owner]]] = OrderedDict()
    for prefix, sub in module.named_modules():
        for name, p in sub._parameters.items():
            if p is None or getattr(p, "_fsdp_managed", False):
                continue  # a sharded child's parameter
            fqn = f"{prefix}.{name}" if prefix else name
            if getattr(p, "_fsdp_claimed", False):
                raise ValueError(
                    f"parameter '{fqn}' is shared with a module already passed to fully_shard; "
                    f"tied parameters must live in one unit: shard their common ancestor instead"
                )
            entries.setdefault(id(p), (p, []))[1].append(Owner(sub, name, fqn))

    dtensor_mesh = dtensor_mesh or _mesh(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    params = [
        ShardedParam(
            p, owners, dtensor_mesh, rank, world, mp.param_dtype, _shard_dim(shard_placement_fn, p), offload_policy
        )
        for p, owners in entries.values()
    ]
    for p, _ in entries.values():
        p._fsdp_claimed = True  # the original, still held by any module outside this unit
    _broadcast_buffers(module, group)
    if replicate_group is not None:  # then every replica takes its rank 0's, which now holds rank 0's
        _broadcast_buffers(module, replicate_group)
    state = UnitState(
        module, ParamGroup(params, group, replicate_group, mp, post_forward), reshard_after_forward, mp.param_dtype
    )
    for _, unit in units(module):  # the units already under `module` prefetch in its forward order
        unit.schedule = state.schedule
    module._fsdp_state = state
    make_fsdp_module(module)
    return module


def _shard_dim(placement_fn, param: nn.Parameter) -> int:
    """The dim `placement_fn` shards `param` on (0 without one, or where it returns None)."""
    placement = placement_fn(param) if placement_fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"fully_shard: shard_placement_fn must return a Shard or None, not {placement!r}")
    return placement.dim % param.dim()


def _post_forward(reshard_after_forward: bool | int | None, group) -> tuple[bool | None, object]:
    """(whether to reshard after forward, None: at all but the root; the post-forward group or None) for a
    bool, None or an int."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    world = dist.get_world_size(group)
    if not isinstance(reshard_after_forward, int) or reshard_after_forward < 1 or world % reshard_after_forward:
        raise ValueError(
            f"fully_shard: reshard_after_forward must be a bool or a divisor of the shard group's "
            f"{world} ranks, not {reshard_after_forward!r}"
        )
    if reshard_after_forward in (1, world):
        return reshard_after_forward == world, None
    return True, post_forward_group(group, reshard_after_forward)


def _mesh(group) -> DeviceMesh:
    """The 1D DeviceMesh of the shard group (made from the group itself: no new communicator)."""
    mesh = DeviceMesh.from_group(group, device_for(group).type)
    if mesh.get_local_rank() != dist.get_rank(group):  # DTensor's coordinate must be the group rank
        raise ValueError("fully_shard: the process group's rank order does not match its DeviceMesh")
    return mesh


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


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Switch the gradient reduction of every unit under `module` off (False) or back on (True), as
    FSDP2's method of the same name does (``module.set_requires_gradient_sync(flag)`` too). While it is
    off, each unit keeps its full, unreduced gradients between backward passes and later ones add to
    them; the first backward with it on reduces the sum once. Gradient accumulation over k
    micro-batches: off for the first k - 1, on for the last. Under HSDP both reductions (over the shard
    group and across replicas) are skipped."""
    for _, state in units(module):
        state.params.sync_grads = bool(requires_gradient_sync)


def full_state_dict(module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters under the names they had in the unwrapped module (collective over
    the shard group: one all-gather per shard group and dtype for the whole module, every unit's padded
    shards packed together; under HSDP every replica gathers its own, identical, copy), in the sharded
    (master) dtype. The gathered buffer is the size of the full parameters, which the result holds anyway.

    ``rank0_only``: gathered to the first rank of each shard group alone (a gather: the other ranks send
    their shards and go on), where a checkpoint or a record of the parameters is written by one rank;
    every other rank gets ``{}``.

    Tied parameters appear once, under the first name, as ``named_parameters()`` gives them.
    Parameters outside any unit are included as they are.
    """
    gathered: dict[int, torch.Tensor] = {}
    shards: dict = {}  # (shard group, world size, dtype) -> every unit's sharded parameters of that dtype
    for _, state in units(module):
        group = state.params
        for p in group.params:
            shards.setdefault((group.group, group.world_size, p.dtype), []).append(p)
    receives = True
    for (process_group, world_size, _), params in shards.items():
        with torch.no_grad():
            send = torch.cat([p.padded for p in params]).to(params[0].device)  # offloaded: to the device
            if rank0_only and world_size > 1 and dist.get_rank(process_group) != 0:
                gather_flat(None, send, process_group)  # sent; nothing comes back here
                receives = False
                continue
            full = torch.empty(world_size * send.numel(), dtype=send.dtype, device=send.device)
            (gather_flat if rank0_only else all_gather_flat)(full, send, process_group)
            # (W, sum of padded shards) -> per parameter (W, its padded shard): its W chunks
            for p, ranks in zip(params, full.view(world_size, -1).split([q.shard_numel for q in params], dim=1)):
                gathered[id(p)] = p.assemble(ranks)
    if not receives:
        return {}
    out = {name: gathered[id(p)] for name, p in sharded_params(module)}
    for name, q in module.named_parameters():
        if not getattr(q, "_fsdp_managed", False):
            out[name] = q.detach().clone()
    return out


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy full parameters (as full_state_dict returns them) into this rank's shards. No collective."""
    expected = set()
    for name, p in sharded_params(module):
        expected.add(name)
        if name not in state_dict:
            raise KeyError(f"missing parameter '{name}' in the state dict")
        value = state_dict[name]
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"'{name}': shape {tuple(value.shape)} != expected {tuple(p.shape)}")
        p.load_full_(value)
    plain = {n: q for n, q in module.named_parameters() if not getattr(q, "_fsdp_managed", False)}
    unexpected = [k for k in state_dict if k not in expected and k not in plain]
    if unexpected:
        raise KeyError(f"unexpected parameters in the state dict: {unexpected[:5]}")
    with torch.no_grad():
        for k, q in plain.items():
            if k in state_dict:
                q.copy_(state_dict[k])
