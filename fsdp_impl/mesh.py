"""Process groups for hybrid sharding (HSDP): R replicas x S shards.

    shard_group, replicate_group = hybrid_groups(replicas=R)      # every rank, once; keep them
    fully_shard(block, process_group=shard_group, replicate_group=replicate_group)

Layout: the W = R x S ranks of `group`, numbered by their rank in it, are
rank = replica * S + shard_index. Replica r's shard group is ranks r*S .. r*S + S - 1 (parameters
are sharded over it: forward and backward gather within it); the replicate group of shard index i
is ranks i, S + i, 2S + i, ...: the ranks at the same position in their shard group, which hold
the same shard (gradients are summed across it). Typically S is the ranks of one node, so that
gathers use the fast intra-node links and only the gradient all-reduce crosses nodes.

``fully_shard`` takes any two groups laid out that way (``check_hybrid_layout`` says which are not).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .collectives import all_gather_single


def hybrid_groups(replicas: int, group=None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's shard group, this rank's replicate group) for `replicas` x S over `group`
    (default WORLD), in the layout of the module docstring.

    Collective: every rank of `group` calls it with the same arguments. It creates R + S process
    groups (each rank keeps two), which is slow (a rendezvous each): call it once and reuse the
    groups for every ``fully_shard`` and every model. When `group` spans the whole job, the
    groups come from plain ``dist.new_group``, which every process calls for every group in the same
    order (torch's rule). When `group` is a strict subgroup, processes outside it do not call: the
    groups are made with ``use_local_synchronization=True``, which torch names from the rank list
    and the number of groups the process already holds, so the ranks of `group` must hold equally
    many (they do when they all ran the same code).
    """
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if not isinstance(replicas, int) or replicas < 1 or world % replicas:
        raise ValueError(
            f"hybrid_groups: the group's {world} ranks cannot be split into replicas={replicas!r} "
            f"equal shard groups (replicas must be a positive divisor of {world})"
        )
    shards = world // replicas
    ranks = [dist.get_global_rank(group, i) for i in range(world)]  # dist.new_group takes global ranks
    whole_job = world == dist.get_world_size()
    me = dist.get_rank(group)
    shard_group = replicate_group = None
    for r in range(replicas):  # every rank creates every group, in this order
        g = _new_group([ranks[r * shards + i] for i in range(shards)], whole_job)
        if r == me // shards:
            shard_group = g
    for i in range(shards):
        g = _new_group([ranks[r * shards + i] for r in range(replicas)], whole_job)
        if i == me % shards:
            replicate_group = g
    return shard_group, replicate_group


# shard group -> {g: this rank's group of g consecutive ranks in it}, made once per (group, g)
_POST_FORWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def post_forward_group(group, size: int):
    """This rank's group of `size` consecutive ranks of `group` (``reshard_after_forward=size``): the shard
    groups of ``hybrid_groups(W // size, group)``, made at the first call for (group, size) and kept.
    Collective the first time: every rank of `group` calls it."""
    made = _POST_FORWARD.setdefault(group, {})
    if size not in made:
        made[size] = hybrid_groups(dist.get_world_size(group) // size, group)[0]
    return made[size]


def _new_group(ranks: list[int], whole_job: bool):
    # sort_ranks=False: a group's rank order is the order given (the layout), not global rank order
    if whole_job:
        return dist.new_group(ranks, sort_ranks=False)
    return dist.new_group(ranks, sort_ranks=False, use_local_synchronization=True)


def check_hybrid_layout(shard_group, replicate_group) -> None:
    """Raise ValueError unless the two groups form the hybrid layout: they share only this rank, and
    every rank of the replicate group has the same shard-group size and the same position in its
    shard group (so all hold the same shard). Collective over both groups (three small collectives);
    a rank that finds a fault tells its shard group and then its replicate group, so that those
    ranks raise together instead of leaving the others waiting in a later collective."""
    me = dist.get_rank()
    shared = set(dist.get_process_group_ranks(shard_group)) & set(dist.get_process_group_ranks(replicate_group))
    device = device_for(replicate_group)
    mine = torch.tensor([dist.get_world_size(shard_group), dist.get_rank(shard_group)], device=device)
    every = torch.empty(2 * dist.get_world_size(replicate_group), dtype=mine.dtype, device=device)
    all_gather_single(every, mine, group=replicate_group)
    every = every.view(-1, 2).cpu()
    fault = ""
    if shared != {me}:
        fault = f"the shard group and the replicate group must share only this rank ({me}), they share {sorted(shared)}"
    elif not bool((every == every[0]).all()):
        fault = (
            f"the replicate group's ranks must hold the same shard: their (shard group size, position) "
            f"are {[tuple(row) for row in every.tolist()]}"
        )
    flag = torch.tensor([1 if fault else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_group)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=replicate_group)
    if fault or int(flag.item()):
        raise ValueError(
            f"fully_shard: process_group / replicate_group do not form the hybrid layout: "
            f"{fault or 'another rank found a fault'} (hybrid_groups builds them)"
        )


def device_for(group) -> torch.device:
    """Where this group's collectives take tensors: the current CUDA device under NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
