"""Faults of the training features (harness/train/features.py): for gradient accumulation, the
reduction switch that does nothing, the switch never turned back on, and an accumulated gradient
averaged over its micro-batches although each micro-batch's loss is already scaled; for clipping, the
norm of the rank's own shard taken for the global norm.
"""

from __future__ import annotations

from suites.mutants.injection import MutantAdapter, _handles, _with_globals


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
