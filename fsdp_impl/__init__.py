"""fsdp_impl: a from-scratch ZeRO-3 (fully sharded data parallel) implementation.

    fully_shard(module, process_group=None, replicate_group=None, reshard_after_forward=True, mp_policy=None,
                shard_placement_fn=None, offload_policy=None)
    fully_shard(module, mesh=mesh, ...)         # FSDP2's form: a 1-D DeviceMesh, or 2-D (replicate, shard) for HSDP
    hybrid_groups(replicas, group=None)         # HSDP: (shard group, replicate group) of this rank
    set_requires_gradient_sync(module, False)   # accumulate micro-batches unreduced; True before the last
    clip_grad_norm_(module, max_norm, norm_type=2.0)   # the global norm over the shard group's shards
    full_state_dict(module) / load_full_state_dict(module, state_dict)
    materialize_meta(module, device)            # after building on "meta" and sharding
    MixedPrecisionPolicy(param_dtype, reduce_dtype)
    invariant_forward_backward(module, loss_fn, x, y, micro_batches=L)  # batch-invariant step: the same bits at any W
    CPUOffloadPolicy(pin_memory=True)           # fully_shard(..., offload_policy=...): shards, gradients, optimizer state on the host
    save_sharded(module, optimizer, path)       # each rank writes its rows (collective; torch.distributed.checkpoint)
    load_sharded(module, optimizer, path)       # at any world size: reshards parameters and optimizer state
    FSDPModule                                  # every sharded module is one (isinstance), with FSDP2's methods:

    model.set_requires_gradient_sync(False)     # as the function above (recurse=False: this unit only)
    block.unshard(async_op=False) / block.reshard()   # this unit; async_op=True returns a handle to wait()
    model.set_reshard_after_forward(bool) / model.set_reshard_after_backward(bool)
    model.set_is_last_backward(bool)            # accepted, changes nothing (reductions end with their backward)
    block.set_modules_to_forward_prefetch([...]) / block.set_modules_to_backward_prefetch([...])

Drop-in for FSDP2: code written for ``torch.distributed.fsdp.fully_shard`` runs with fsdp_impl's: ``mesh=``,
FSDP2's MixedPrecisionPolicy / OffloadPolicy / CPUOffloadPolicy objects, ``reshard_after_forward=None``,
``shard_placement_fn``, the methods above, and ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
(torch computes the global norm from the DTensor gradients). Refused with a ValueError: ``ignored_params``,
``dp_mesh_dims``, a list of modules, ``MixedPrecisionPolicy.output_dtype`` and ``cast_forward_inputs=False``
(compat.py); FSDP2's methods that change the reduction are not there (module.py says which and why).

Per-parameter sharding: after ``fully_shard`` every parameter is, under its original name, a DTensor
sharded Shard(0) over the shard group's DeviceMesh (param.py); a unit's parameters move together,
one all-gather and one gradient reduction per unit (group.py), driven by module and autograd hooks
(state.py). ``model.state_dict()`` gives the DTensors without communication.

Hybrid sharding (HSDP, R replicas x S shards): ``shard, rep = hybrid_groups(R)`` once, then
``fully_shard(unit, process_group=shard, replicate_group=rep)``; gathers stay within the shard
group, gradients are averaged over all R x S ranks (see mesh.py for the rank layout).

Knows nothing of the harness; any training loop can use it.
"""

from .api import full_state_dict, fully_shard, load_full_state_dict, set_requires_gradient_sync
from .checkpoint import load_sharded, save_sharded
from .clip import clip_grad_norm_
from .invariant import invariant_forward_backward
from .mesh import hybrid_groups
from .meta_init import materialize_meta
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule, UnshardHandle
from .offload import CPUOffloadPolicy

__all__ = [
    "fully_shard",
    "hybrid_groups",
    "set_requires_gradient_sync",
    "clip_grad_norm_",
    "full_state_dict",
    "load_full_state_dict",
    "save_sharded",
    "load_sharded",
    "materialize_meta",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "invariant_forward_backward",
    "FSDPModule",
    "UnshardHandle",
]
