"""Faults of the training features (harness/train/features.py): for gradient accumulation, the
reduction switch that does nothing, the switch never turned back on, and an accumulated gradient
averaged over its micro-batches although each micro-batch's loss is already scaled; for clipping, the
norm of the rank's own shard taken for the global norm; for mixed precision, the optimizer stepping
in bf16 and the gradients summed in bf16; for activation checkpointing, a reduction run again after
the recomputation; for hybrid sharding, replicas that never average; for checkpoints, the last rank's
part or the optimizer state misplaced on reload, and the optimizer's step counter not restored.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from harness.adapters.base import PLAIN_WRAP
from suites.mutants.injection import (
    MutantAdapter,
    ReductionReplaced,
    around,
    param_groups_of,
    rebind,
    sharded_params_of,
    unit_states_of,
    with_globals,
)


class SyncIgnored(MutantAdapter):
    """The reduction switch does nothing: every micro-batch's gradient is reduced, as with no switch
    (the numbers are the same; the traffic is k reductions instead of one)."""

    name = "mutant:sync_ignored"

    def set_gradient_sync(self, wrapped, enabled):
        return None


class HeldInParamDtype(MutantAdapter):
    """Under bf16 with the reduction switched off, the unreduced gradients of the micro-batches add up in
    bf16, as autograd leaves them (each pass's sum rounded to 8 significant bits), not in the reduction's
    fp32: only the composition no_sync+bf16 has such a sum; either feature alone is right."""

    name = "mutant:held_in_param_dtype"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            g.hold_grads = lambda: None


class SyncNeverRestored(MutantAdapter):
    """The switch turns the reduction off and never back on: the accumulated gradient is never
    reduced, so the sharded parameters get no gradient at all. At every world size, W = 1 included
    (its gradient too reaches the sharded parameter only through the reduction): W = 1 leaves the
    plain model at step 1 (ws1_exact), and replicated W > 1 runs equal the faulty W = 1 run."""

    name = "mutant:sync_never_restored"

    def set_gradient_sync(self, wrapped, enabled):
        if not enabled:
            super().set_gradient_sync(wrapped, enabled)


class AccumAveraged(MutantAdapter):
    """The gradient accumulated over unreduced micro-batches is divided by their count before it is
    reduced, as if each micro-batch's loss were not already scaled: the step's gradient is 1/k of it.
    Each unit counts its backward passes (its pre-backward hook, once per backward) and divides its
    unsharded gradients by that count when it reduces them."""

    name = "mutant:accum_averaged"

    def mutate(self, wrapped):
        from fsdp_impl.state import TrainingState

        for _, state in unit_states_of(wrapped):
            g = state.params
            if not g.params:
                continue
            passes = {"n": 0}  # backward passes since the unit last reduced

            def pre_backward(product, grad, state=state, passes=passes):
                if state.training_state is not TrainingState.PRE_BACKWARD:  # the first hook of this backward
                    passes["n"] += 1
                return product(grad)

            def reduce_averaged(product, g=g, passes=passes):
                if passes["n"] > 1:
                    with torch.no_grad():
                        for p in g.params:
                            if p.unsharded_grad() is not None:
                                p.unsharded.grad.div_(passes["n"])
                passes["n"] = 0
                product()

            around(state, "_pre_backward", pre_backward)  # registered on the outputs at each forward
            around(g, "reduce_grads", reduce_averaged)


class ClipLocalNorm(MutantAdapter):
    """Gradient clipping by the norm of the rank's own shard, not the global norm (as
    ``torch.nn.utils.clip_grad_norm_`` computes on the shards' local tensors): off by about sqrt(W) for L2, and each
    rank scales by a coefficient of its own."""

    name = "mutant:clip_local_norm"

    def clip_grad_norm(self, wrapped, max_norm, norm_type):
        from fsdp_impl import clip

        local = with_globals(clip.clip_grad_norm_, all_reduce_norm=lambda value, op, group: None)
        return float(local(wrapped, max_norm, norm_type))


class ClipNormReportedLocal(MutantAdapter):
    """Clipping by the global norm, as it should, but ranks > 0 return the norm of their own shard (the global
    one on rank 0 only): the tables keep rank 0's records, so only every rank's word shows it."""

    name = "mutant:clip_norm_reported_local"

    def clip_grad_norm(self, wrapped, max_norm, norm_type):
        import torch
        import torch.distributed as dist

        from fsdp_impl import clip_grad_norm_

        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            for p in wrapped.parameters()
            if p.grad is not None
        ]
        local = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1).float() for g in grads]), norm_type))
        total = float(clip_grad_norm_(wrapped, max_norm, norm_type))
        return total if dist.get_rank() == 0 else local


class Bf16OptimizerStep(MutantAdapter):
    """Under a bf16 policy, the optimizer steps bf16 master parameters: after each step the shards
    keep only what bf16 holds (every update rounded to bf16's 8 significant bits)."""

    name = "mutant:bf16_optimizer_step"

    def wrap(self, model, units, *, group, device, options=PLAIN_WRAP):
        wrapped = super().wrap(model, units, group=group, device=device, options=options)
        wrapped._mutant_low_precision = options.param_dtype
        return wrapped

    def make_optimizer(self, wrapped, *, name, lr):
        optimizer = super().make_optimizer(wrapped, name=name, lr=lr)
        low = getattr(wrapped, "_mutant_low_precision", None)
        if low is not None:
            step = optimizer.step

            def step_in_low_precision(*args, **kwargs):
                out = step(*args, **kwargs)
                with torch.no_grad():
                    for group in optimizer.param_groups:
                        for p in group["params"]:
                            p.copy_(p.to(low).to(p.dtype))
                return out

            optimizer.step = step_in_low_precision
        return optimizer


class Bf16Summed(ReductionReplaced):
    """Under a bf16 policy the reduce dtype is ignored: the ranks' gradients are summed in the gradients'
    own dtype, bf16 (as FSDP2 does when MixedPrecisionPolicy leaves reduce_dtype None), so each averaged
    element keeps 8 significant bits. Only split data shows it: one rank's bf16 gradient, or W equal
    ones, average to a bf16 value exactly; W different ones do not."""

    name = "mutant:bf16_summed"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return mean(full_grad, group, reduce_dtype).to(full_grad.dtype)


class AcReducedTwice(MutantAdapter):
    """Under activation checkpointing, a unit's post-backward reduction runs a second time, as when an
    implementation re-arms its gradient hook on every forward and the recomputation in backward is one:
    the reduced gradient is added twice. Units that are not checkpointed are left as they are."""

    name = "mutant:ac_reduced_twice"

    def mutate(self, wrapped):
        for _, state in unit_states_of(wrapped):
            if "forward" not in vars(state.module):  # checkpointing replaces the unit's forward (features.py)
                continue
            g = state.params

            def reduce_twice(product, g=g):
                grads = {id(p): p.unsharded.grad.clone() for p in g.params if p.unsharded_grad() is not None}
                product()
                if grads:
                    for p in g.params:
                        if id(p) in grads:
                            p.unsharded.grad = grads[id(p)]
                    product()  # the same reduction again, added to the sharded gradient

            around(g, "reduce_grads", reduce_twice)


class ReplicasNotAveraged(MutantAdapter):
    """Hybrid sharding whose replicas never average their gradients: each replica's shard group reduces
    its own mean and steps on it, so with split data the replicas train on their own samples and drift
    apart (with replicated data every replica's mean is the same: nothing to see there)."""

    name = "mutant:replicas_not_averaged"

    def mutate(self, wrapped):
        from fsdp_impl.collectives import reduce_scatter_mean

        def shard_group_only(full_grad, shard_group, replicate_group, reduce_dtype, out_dtype=None):
            return reduce_scatter_mean(full_grad, shard_group, reduce_dtype, out_dtype)

        for _, g in param_groups_of(wrapped):
            rebind(g, "reduce_grads", hybrid_reduce_mean=shard_group_only)


class CkptLastRankShifted(MutantAdapter):
    """A checkpoint reloaded with the last rank's part one element late, as when the tail padding of
    the saved layout is not the one of the loading layout: on the last rank, each parameter's rows
    (the rows before its padding) are read one element late, so every value there is misplaced."""

    name = "mutant:ckpt_last_rank_shifted"

    def load_checkpoint(self, wrapped, optimizer, path):
        import torch.distributed as dist

        super().load_checkpoint(wrapped, optimizer, path)
        for _, p in sharded_params_of(wrapped):
            if p.rank != p.world_size - 1 or not p.local_numel:
                continue
            own = p.padded[: p.local_numel]  # this rank's rows, before the padding
            with torch.no_grad():
                own.copy_(torch.roll(own.clone(), 1))
        dist.barrier(group=param_groups_of(wrapped)[0][1].group)


class CkptOptimizerStateShifted(MutantAdapter):
    """A checkpoint reloaded with the parameters in place but the optimizer state one element off (each
    rank's part of every state tensor shaped like its parameter read one element late, as when it is
    cut at the offsets of another layout): wrong in the state right after loading, and in the first
    steps after resuming."""

    name = "mutant:ckpt_optimizer_state_shifted"

    def load_checkpoint(self, wrapped, optimizer, path):
        super().load_checkpoint(wrapped, optimizer, path)
        with torch.no_grad():
            for param, state in optimizer.state.items():
                for value in state.values():
                    if isinstance(value, DTensor) and value.shape == param.shape:
                        local = value._local_tensor.view(-1)
                        local.copy_(torch.roll(local.clone(), 1))


class CkptStepRestarted(MutantAdapter):
    """A checkpoint reloaded with everything in place but the optimizer's step counter, left at 0 on
    every rank as in a fresh optimizer (the count not read back from the checkpoint): the moments are
    right, only AdamW's bias correction starts over, so the steps after resuming still move every
    parameter the right way, by amounts a little off."""

    name = "mutant:ckpt_step_restarted"

    def load_checkpoint(self, wrapped, optimizer, path):
        super().load_checkpoint(wrapped, optimizer, path)
        for state in optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.zeros_like(state["step"])
