"""Mutants that put or read shards in the wrong place: shard offsets, padding, views over the flat
buffer (layout and padding), and which unit and which rank a parameter's shard belongs to.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.adapters.fsdp_impl import FsdpImplAdapter
from suites.mutants.injection import MutantAdapter, _collectives, _handles, _rebind


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# --------------------------------------------------------------------------- layout and padding

class _FloorOffsetLayout:
    """Mixin over a FlatLayout: each rank's shard starts at rank x floor(N / W) instead of
    rank x ceil(N / W) (N = elements used), so a rank past the first copies the wrong slice."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        start = rank * (self.used_numel // self.world_size)
        return start, start + self.shard_numel


class WrongShardOffset(MutantAdapter):
    """Shards filled at a wrong offset (floor instead of ceil of N / W): rank r >= 1 holds the flat
    parameter shifted by r x (ceil - floor) elements, so the gathered parameters are misplaced."""

    name = "mutant:wrong_shard_offset"

    def wrap(self, model, units, *, group, device):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        wrapped = FsdpImplAdapter.wrap(self, model, units, group=group, device=device)
        for prefix, h in _handles(wrapped):
            layout = h.layout
            cls = type(f"FloorOffset{type(layout).__name__}", (_FloorOffsetLayout, type(layout)), {})
            h.layout = cls(layout.slots, layout.world_size)
            with torch.no_grad():
                h.shard.zero_()
            for slot in h.layout.slots:
                h.load_full(slot, values[_join(prefix, slot.fqn)])
        return wrapped


class PaddingNotZeroed(MutantAdapter):
    """Padding never re-zeroed (not in the reduced gradient, not before a gather) while the reduce
    input's padding holds stale memory (a buffer allocated with torch.empty, modelled as 0.5):
    the optimizer writes values into the padding, and they leak into everything that reads the
    flat shards (gradient norm, clipping, non-elementwise optimizers)."""

    name = "mutant:padding_not_zeroed"
    JUNK = 0.5

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean
        for _, h in _handles(wrapped):
            layout = h.layout
            pad = [(a + layout.rank_range(r)[0], b + layout.rank_range(r)[0])
                   for r in range(layout.world_size) for a, b in layout.padding_mask_ranges(r)]

            def reduce_from_dirty_buffer(full_grad, group, reduce_dtype, pad=pad):
                buf = full_grad.clone()
                for a, b in pad:
                    buf[a:b] = self.JUNK
                return mean(buf, group, reduce_dtype)

            h.zero_padding_ = lambda flat_shard: None
            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_from_dirty_buffer)


class PaddingInView(MutantAdapter):
    """Views taken at packed offsets (the sum of the previous parameters' sizes) while the flat
    buffer is laid out with aligned offsets: a parameter after an alignment gap starts inside the
    zero padding, which leaks into its unpadded view."""

    name = "mutant:padding_in_view"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):

            def set_packed_views(full, h=h):
                offset = 0
                for slot, owners in zip(h.layout.slots, h.owners):
                    view = full[offset:offset + slot.numel].view(slot.shape)
                    for o in owners:
                        setattr(o.module, o.name, view)
                    offset += slot.numel

            h._set_views = set_packed_views


# ---------------------------------------------------------------------------- units and ranks

class NestedDuplication(MutantAdapter):
    """A parameter in two units: the root's fully_shard does not see that the blocks' parameters
    were already claimed by their own units and shards them again (every parameter twice in memory
    and gathered twice per pass; training follows the inner copy, so the numbers look right)."""

    name = "mutant:nested_duplication"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import fully_shard

        model.to(device)
        owned = [(sub, name, p) for sub in model.modules() for name, p in sub._parameters.items() if p is not None]
        for unit in units:
            fully_shard(unit, process_group=group)
        for sub, name, p in owned:
            if name not in sub._parameters:  # taken by a unit: make it visible to the root again
                p._fsdp_claimed = False
                sub._parameters[name] = p
        return fully_shard(model, process_group=group)


class StaleShard(MutantAdapter):
    """The last rank all-gathers a stale copy of its shard: it caches the shard it sends (as a
    param-dtype cast cache would) and never invalidates it after optimizer.step()."""

    name = "mutant:stale_shard"

    def mutate(self, wrapped):
        gather = _collectives().all_gather_flat
        for _, h in _handles(wrapped):
            if h.rank != h.world_size - 1 or h.world_size == 1:
                continue
            cache: dict[str, Tensor] = {}

            def gather_cached(out, shard, group, cache=cache):
                if "shard" not in cache:
                    cache["shard"] = shard.detach().clone()
                return gather(out, cache["shard"], group)

            _rebind(h, "_fill_full", all_gather_flat=gather_cached)


class TieBroken(MutantAdapter):
    """Tied weights untied on wrapping (the head gets a copy of the embedding, as a wrapper that
    re-registers each module's parameters would do): each copy trains on its own gradient only."""

    name = "mutant:tie_broken"

    def wrap(self, model, units, *, group, device):
        head = getattr(model, "head", None)
        if head is not None and head.weight is getattr(getattr(model, "embed", None), "weight", None):
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        return super().wrap(model, units, group=group, device=device)
