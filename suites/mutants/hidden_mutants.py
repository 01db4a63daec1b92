"""Faults an implementation can hide from what it reports, and correct implementations that do
things the harness once mistook for faults.

The harness measures the rank process, not the adapter's word: the parameters the plain model has
(not only those `full_params` lists), every storage the rank holds (not only parameters, gradients
and `optimizer.state`), the collectives of every thread. Each mutant here hides its fault where an
adapter-reported figure would not look; each control reduces gradients in a way ZeRO-1/2 code does
(a reduce or a gather to each part's owner) and must pass every check. One mutant is the reduce control with its
owners one rank off (a stage-1 partition reduced to the wrong rank, a fault modelled on DeepSpeed's ZeRO-1/2
reductions): it hides nothing, and sits here beside the control it breaks.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from suites.mutants.injection import (
    MutantAdapter,
    ReductionReplaced,
    around,
    collectives_module,
    param_groups_of,
    sharded_params_of,
)


class ParamLeftOut(MutantAdapter):
    """`full_params` leaves out one parameter: whatever happens to it is never compared."""

    name = "mutant:param_left_out"

    def full_params(self, wrapped):
        full = super().full_params(wrapped)
        full.pop(sorted(full)[-1])
        return full


class UnitBufferKept(MutantAdapter):
    """Each unit keeps a copy of its gathered parameters when it reshards (a cache that is never
    read): a full-size buffer per unit between steps, held in the unit's ParamGroup, not in any
    parameter, gradient or optimizer state (memory only)."""

    name = "mutant:unit_buffer_kept"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):

            def keep_then_reshard(product, *args, g=g, **kwargs):
                full = [
                    p.unsharded.detach().clone() for p in g.params if p.unsharded is not None and p.unsharded_nbytes()
                ]
                if full:
                    g.cache = full
                product(*args, **kwargs)

            around(g, "reshard", keep_then_reshard)


class OptimizerShadowState(MutantAdapter):
    """The optimizer keeps a full-size (W x the padded shard) copy of each parameter's state in its own
    attribute, outside `optimizer.state`, where no adapter-reported figure looks (memory only)."""

    name = "mutant:optimizer_shadow_state"

    def make_optimizer(self, wrapped, *, name, lr):
        opt = super().make_optimizer(wrapped, name=name, lr=lr)
        opt.shadow = [
            torch.zeros(p.world_size * p.shard_numel, dtype=p.dtype, device=p.device)
            for _, p in sharded_params_of(wrapped)
            if p.requires_grad
        ]
        return opt


class PrefetchThreadGather(MutantAdapter):
    """A prefetch thread all-gathers the first unit's parameters once more every forward and never
    uses them: traffic issued from a thread the measured step does not run in (numbers unchanged)."""

    name = "mutant:prefetch_thread_gather"

    def mutate(self, wrapped):
        all_gather_flat = collectives_module().all_gather_flat
        _, g = param_groups_of(wrapped)[0]

        def prefetch(module, args):
            if g.world_size == 1:
                return
            send = torch.cat([p.padded.detach().to(p.param_dtype) for p in g.params])
            out = torch.empty(g.world_size * send.numel(), dtype=send.dtype, device=send.device)
            t = threading.Thread(target=all_gather_flat, args=(out, send, g.group))
            t.start()
            t.join()

        wrapped.register_forward_pre_hook(prefetch)


def _reduce_to_owners(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype, shift: int = 0) -> torch.Tensor:
    """ZeRO-1/2 style: each rank's part reduced (summed) on the rank that owns it, then averaged. `shift` (a
    mutant's): part p is reduced on rank p + shift instead, which returns it as its own."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return full_grad.to(reduce_dtype)
    parts = full_grad.to(reduce_dtype).view(world, -1)
    for part in range(world):
        dist.reduce(parts[part], dst=dist.get_global_rank(group, (part + shift) % world), group=group)
    return parts[(rank - shift) % world].clone().div_(world)


def _gather_to_owners(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype) -> torch.Tensor:
    """Each part gathered on its owner, which sums the W copies in rank order in `reduce_dtype`."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return full_grad.to(reduce_dtype)
    parts = full_grad.contiguous().view(world, -1)
    mine = None
    for owner in range(world):
        got = [torch.empty_like(parts[owner]) for _ in range(world)] if owner == rank else None
        dist.gather(parts[owner].contiguous(), got, dst=dist.get_global_rank(group, owner), group=group)
        if got is not None:
            mine = collectives_module().sum_in_rank_order(torch.stack(got), reduce_dtype)
    return mine.div_(world)


class ReduceToOwners(ReductionReplaced):
    """Control: gradients reduced with one `reduce` per part to its owner (fp64, as the product)."""

    name = "control:reduce_to_owners"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return _reduce_to_owners(full_grad, group, reduce_dtype)


class ReducedToWrongOwner(ReductionReplaced):
    """ZeRO-1/2 style reduce to owners with each part's destination one rank off: rank r receives the sum of rank
    r - 1's part and steps its own rows with it (at W = 1 there is no other rank: the W = 1 run is right)."""

    name = "mutant:reduced_to_wrong_owner"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return _reduce_to_owners(full_grad, group, reduce_dtype, shift=1)


class GatherToOwners(ReductionReplaced):
    """Control: each part gathered on its owner and summed there in rank order (fp64)."""

    name = "control:gather_to_owners"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return _gather_to_owners(full_grad, group, reduce_dtype)


class DelegatingOptimizer(torch.optim.Optimizer):
    """An optimizer wrapper whose own `state` stays empty: the torch optimizer inside it holds the
    state and does the step, as training libraries' optimizer wrappers do."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__(inner.param_groups, inner.defaults)
        self.inner = inner

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


class OptimizerDelegated(MutantAdapter):
    """Control: fsdp_impl trained through a delegating optimizer wrapper (state in the inner optimizer)."""

    name = "control:optimizer_delegated"

    def make_optimizer(self, wrapped, *, name, lr):
        return DelegatingOptimizer(super().make_optimizer(wrapped, name=name, lr=lr))
