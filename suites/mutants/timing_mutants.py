"""Faults that depend on when asynchronous work finishes: harmless while every collective is done before
anything reads it, wrong once a rank arrives late (the feature jitter).

On gloo a collective completes only once every rank has issued it, so how early a read may come depends on
how far the ranks are apart, which on a loaded machine is the scheduler's doing: such a fault is a real race
and may show without jitter too (measured in the catalogue's entry).
"""

from __future__ import annotations

import types

import torch

from suites.mutants.injection import MutantAdapter, around, param_groups_of


def _wait_unshard_reading_early(self) -> None:
    """fsdp_impl's ``ParamGroup.wait_unshard`` with one line moved: for an all-gather issued ahead (a
    prefetch) each rank's rows are copied out of the receive buffer BEFORE the wait on the gather, as if a
    prefetched gather had surely arrived by the time the unit's forward (or backward) comes. An unshard
    issued and completed at once (no prefetch) waits first, as the product does."""
    if self._pending is None:
        return
    pending, self._pending = self._pending, None
    prefetched, self.prefetched = getattr(self, "prefetched", False), False
    for params, sizes, _send, received, work in pending:
        if work is not None and not prefetched:
            work.wait()
        outs = [p.alloc_unsharded() for p in params]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            if received is None:
                torch._foreach_copy_([o.view(-1) for o in outs], [p.padded for p in params])
            else:
                torch.split_with_sizes_copy(received.view(self.world_size, -1), sizes, dim=1, out=outs)
        if work is not None and prefetched:
            work.wait()  # the fault: the rows were read above, while the gather may still have been on its way
        for buffer in (received, _send):
            if buffer is not None:
                buffer.untyped_storage().resize_(0)
    for p in self.params:
        p.to_unsharded()
    self.state = type(self.state).UNSHARDED


class GatherReadEarly(MutantAdapter):
    """A prefetched all-gather's output read before waiting for it (``wait_unshard``: the copy-out before
    ``work.wait()``). Where the ranks reach the prefetch together the gather of the mlp's small units has
    arrived by the time it is read; under jitter a rank whose part is late leaves the other reading a buffer
    the gather has not written yet."""

    name = "mutant:gather_read_early"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            g.wait_unshard = types.MethodType(_wait_unshard_reading_early, g)

            def unshard(product, async_op=False, g=g):
                if async_op and g._pending is None and not g.gathering and g.state.name == "SHARDED":
                    g.prefetched = True  # issued ahead: its wait comes from a later hook
                return product(async_op=async_op)

            around(g, "unshard", unshard)
