"""Faults of the training features (harness/train/features.py): for gradient accumulation, the
reduction switch that does nothing, the switch never turned back on, and an accumulated gradient
averaged over its micro-batches although each micro-batch's loss is already scaled; for clipping, the
norm of the rank's own shard taken for the global norm; for mixed precision, the optimizer stepping
in bf16; for activation checkpointing, a reduction run again after the recomputation; for hybrid
sharding, replicas that never average; for checkpoints, the last rank's part or the optimizer state
misplaced on reload.
"""

from __future__ import annotations

import torch

from suites.mutants.injection import MutantAdapter, _handles, _rebind, _units, _with_globals


class SyncIgnored(MutantAdapter):
    """The reduction switch does nothing: every micro-batch's gradient is reduced, as with no switch
    (the numbers are the same; the traffic is k reductions instead of one)."""

    name = "mutant:sync_ignored"

    def set_gradient_sync(self, wrapped, enabled):
        return None


class SyncNeverRestored(MutantAdapter):
    """The switch turns the reduction off and never back on: the accumulated gradient is never
    reduced, so the sharded parameters get no gradient at all."""

    name = "mutant:sync_never_restored"

    def set_gradient_sync(self, wrapped, enabled):
        if not enabled:
            super().set_gradient_sync(wrapped, enabled)


class AccumAveraged(MutantAdapter):
    """The gradient accumulated over unreduced micro-batches is divided by their count before it is
    reduced, as if each micro-batch's loss were not already scaled: the step's gradient is 1/k of it."""

    name = "mutant:accum_averaged"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            def post_backward(full, h=h, product=type(h)._post_backward):
                h.passes = getattr(h, "passes", 0) + 1
                if h.sync_grads:
                    if full.grad is not None:
                        full.grad.div_(h.passes)
                    h.passes = 0
                product(h, full)

            h._post_backward = post_backward


class ClipLocalNorm(MutantAdapter):
    """Gradient clipping by the norm of the rank's own shard, not the global norm (as
    ``torch.nn.utils.clip_grad_norm_`` computes on flat shards): off by about sqrt(W) for L2, and each
    rank scales by a coefficient of its own."""

    name = "mutant:clip_local_norm"

    def clip_grad_norm(self, wrapped, max_norm, norm_type):
        from fsdp_impl import clip

        local = _with_globals(clip.clip_grad_norm_, all_reduce_norm=lambda value, op, group: None)
        return float(local(wrapped, max_norm, norm_type))


class Bf16OptimizerStep(MutantAdapter):
    """Under a bf16 policy, the optimizer steps bf16 master parameters: after each step the shards
    keep only what bf16 holds (every update rounded to bf16's 8 significant bits)."""

    name = "mutant:bf16_optimizer_step"

    def wrap_mixed_precision(self, model, units, *, group, device, param_dtype, reduce_dtype):
        wrapped = super().wrap_mixed_precision(model, units, group=group, device=device, param_dtype=param_dtype,
                                               reduce_dtype=reduce_dtype)
        wrapped._mutant_low_precision = param_dtype
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


class AcReducedTwice(MutantAdapter):
    """Under activation checkpointing, a unit's post-backward reduction runs a second time, as when an
    implementation re-arms its gradient hook on every forward and the recomputation in backward is one:
    the reduced gradient is added twice. Units that are not checkpointed are left as they are."""

    name = "mutant:ac_reduced_twice"

    def mutate(self, wrapped):
        for _, state in _units(wrapped):
            if "forward" not in vars(state.module):  # checkpointing replaces the unit's forward (features.py)
                continue
            for h in state.handles:
                def post_backward(full, h=h, product=type(h)._post_backward):
                    grad = full.grad.clone() if h.sync_grads and full.grad is not None else None
                    product(h, full)
                    if grad is not None:
                        full.grad = grad
                        product(h, full)  # the same reduction again, added to the shard's gradient

                h._post_backward = post_backward


class ReplicasNotAveraged(MutantAdapter):
    """Hybrid sharding whose replicas never average their gradients: each replica's shard group reduces
    its own mean and steps on it, so with split data the replicas train on their own samples and drift
    apart (with replicated data every replica's mean is the same: nothing to see there)."""

    name = "mutant:replicas_not_averaged"

    def mutate(self, wrapped):
        from fsdp_impl.collectives import reduce_scatter_mean

        def shard_group_only(full_grad, shard_group, replicate_group, reduce_dtype):
            return reduce_scatter_mean(full_grad, shard_group, reduce_dtype)

        for _, h in _handles(wrapped):
            _rebind(h, "_post_backward", hybrid_reduce_mean=shard_group_only)


class CkptLastRankShifted(MutantAdapter):
    """A checkpoint reloaded with the last rank's part one element late, as when the tail padding of
    the saved layout is not the one of the loading layout: every value on the last rank is misplaced."""

    name = "mutant:ckpt_last_rank_shifted"

    def load_checkpoint(self, wrapped, optimizer, path):
        import torch.distributed as dist

        super().load_checkpoint(wrapped, optimizer, path)
        for _, h in _handles(wrapped):
            if h.rank != h.world_size - 1:
                continue
            lo = h.layout.rank_range(h.rank)[0]
            n = max(0, min(h.layout.shard_numel, h.layout.used_numel - lo))  # this rank's non-padding part
            with torch.no_grad():
                h.shard[:n].copy_(torch.roll(h.shard[:n].clone(), 1))
        dist.barrier(group=_handles(wrapped)[0][1].group)


class CkptOptimizerStateShifted(MutantAdapter):
    """A checkpoint reloaded with the parameters in place but the optimizer state one element off (the
    state cut at the offsets of another layout): the first steps after resuming go wrong."""

    name = "mutant:ckpt_optimizer_state_shifted"

    def load_checkpoint(self, wrapped, optimizer, path):
        super().load_checkpoint(wrapped, optimizer, path)
        with torch.no_grad():
            for state in optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.dim() == 1:
                        value.copy_(torch.roll(value.clone(), 1))
