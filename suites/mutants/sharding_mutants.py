"""Mutants that put or read shards in the wrong place: shard offsets, padding (the zero rows that
pad each parameter's chunk to ceil(R / W) rows), the unsharded views read out of the gathered
buffer, and which unit and which rank a parameter's shard belongs to.
"""

from __future__ import annotations

import torch
from torch import Tensor

from harness.adapters.fsdp_impl import FsdpImplAdapter
from suites.mutants.injection import (
    MutantAdapter,
    around,
    collectives_module,
    param_groups_of,
    rebind,
    sharded_params_of,
)

# --------------------------------------------------------------------------- layout and padding


class WrongShardOffset(MutantAdapter):
    """Shards filled at a wrong offset: rank r's rows of each parameter start at r x floor(R / W)
    instead of r x ceil(R / W) (R = the parameter's rows, dim 0), so a rank past the first holds
    the rows before its own and the gathered parameters are misplaced (the last rows are lost)."""

    name = "mutant:wrong_shard_offset"

    def wrap(self, model, units, *, group, device):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        wrapped = FsdpImplAdapter.wrap(self, model, units, group=group, device=device)
        for name, p in sharded_params_of(wrapped):
            rows = p.end - p.start  # as many rows as the rank holds, from the wrong first row
            p.start = p.rank * (p.rows // p.world_size)
            p.end = p.start + rows
            p.load_full_(values[name])
        return wrapped


class PaddingNotZeroed(MutantAdapter):
    """Padding never cut off and never zeroed, while the reduce buffer's padding holds stale memory:
    on a rank holding fewer than c = ceil(R / W) rows of a parameter (the last ranks), its sharded
    parameter and gradient span the whole padded chunk of c rows, padding rows included, and the
    unit's reduce buffer pads with stale memory (a buffer allocated with torch.empty instead of
    ``_chunk_cat``'s zero rows, modelled as 0.5). The optimizer writes values into the padding rows,
    and they leak into everything that reads the rank's gradient (gradient norm, clipping,
    non-elementwise optimizers); the gathered parameters drop them (the tail of the all-gather)."""

    name = "mutant:padding_not_zeroed"
    JUNK = 0.5

    def mutate(self, wrapped):
        mean = collectives_module().reduce_scatter_mean
        for _, g in param_groups_of(wrapped):
            for p in g.params:
                if p.end - p.start < p.chunk:
                    self._expose_padding(p)
            reducing: dict = {}

            def record(product, g=g, reducing=reducing):
                reducing["params"] = [p for p in g.params if p.requires_grad and p.unsharded_grad() is not None]
                product()

            def reduce_from_dirty_buffer(full_grad, group, reduce_dtype, out_dtype=None, g=g, reducing=reducing):
                buf = full_grad.clone().view(g.world_size, -1)  # chunk r: every parameter's rows for rank r
                offset = 0
                for p in reducing["params"]:
                    for r in range(g.world_size):
                        own = min(max(p.rows - r * p.chunk, 0), p.chunk)  # rows rank r holds; the rest pad
                        buf[r, offset + own * p.row_numel : offset + p.shard_numel] = self.JUNK
                    offset += p.shard_numel
                return mean(buf.view(-1), group, reduce_dtype)

            rebind(g, "reduce_grads", reduce_scatter_mean=reduce_from_dirty_buffer)
            around(g, "reduce_grads", record)

    @staticmethod
    def _expose_padding(p) -> None:
        """p's sharded parameter over its whole padded chunk; its reduced chunk kept whole as its gradient."""
        chunk_shape = (p.chunk, *p.shape[1:])
        p.sharded = torch.nn.Parameter(p.to_dtensor(p.padded.view(chunk_shape)), requires_grad=p.requires_grad)
        p.sharded._fsdp_managed = True
        p.set_on_modules(p.sharded)

        def keep_padding(product, padded_grad, p=p):
            whole = padded_grad.view(chunk_shape)
            if p.sharded.grad is None:
                p.sharded.grad = p.to_dtensor(whole)
            else:
                with torch.no_grad():
                    p.sharded.grad._local_tensor.add_(whole)

        around(p, "add_reduced_grad", keep_padding)


class PaddingInView(MutantAdapter):
    """The unsharded parameters read at packed offsets out of a padded gather: every rank sends each
    parameter's rows padded to c = ceil(R / W) rows, one after the other, but each parameter is read
    from where it would start if the previous parameters' rows came unpadded (the sum of the rows
    that rank holds). On a rank that holds fewer than c rows of a parameter (the last ones), the
    zero padding leaks into the unsharded view of the next parameter, whose rows are misplaced.
    Modelled in the all-gather's output (what the copy-out reads). World size 1 has no padding."""

    name = "mutant:padding_in_view"

    def mutate(self, wrapped):
        gather = collectives_module().all_gather_flat
        for _, g in param_groups_of(wrapped):
            if g.world_size == 1:
                continue

            def gather_read_packed(out, shard, group, *args, g=g, **kwargs):
                done = gather(out, shard, group, *args, **kwargs)
                if done is not None:  # an asynchronous gather (a prefetch): its output is there only now
                    done.wait()
                rows = out.view(g.world_size, -1)  # rank r's padded shards, parameter after parameter
                for r in range(g.world_size):
                    sent = rows[r].clone()
                    padded_at = packed_at = 0
                    for p in g.params:
                        rows[r, padded_at : padded_at + p.shard_numel] = sent[packed_at : packed_at + p.shard_numel]
                        padded_at += p.shard_numel
                        packed_at += min(max(p.rows - r * p.chunk, 0), p.chunk) * p.row_numel
                return done

            rebind(g, "unshard", all_gather_flat=gather_read_packed)


class TailBeforeLastDropped(MutantAdapter):
    """The one short chunk of an uneven parameter assumed to be the last rank's: a rank's reduced gradient
    becomes its shard's ``.grad`` only where the rank holds a full chunk of c = ceil(R / W) rows or is the
    last rank; any other rank's chunk is taken for padding alone and its gradient dropped, so the optimizer
    skips those rows and they never leave their initial value. The assumption fails where a rank before the
    last holds more than none and fewer than c rows, the ranks after it none ((W - 1) x c > R and R not a
    multiple of c): tied_vocab33's 33 rows at W = 8, rows 30-32 on rank 6 of 8. No other zoo parameter has
    that layout at 2, 4 or 8 ranks (suites/harness/unit/test_models.py)."""

    name = "mutant:tail_before_last_dropped"

    def mutate(self, wrapped):
        for _, p in sharded_params_of(wrapped):
            if 0 < p.end - p.start < p.chunk and p.rank != p.world_size - 1:
                around(p, "add_reduced_grad", lambda product, padded_grad: None)


# ---------------------------------------------------------------------------- units and ranks


class NestedDuplication(MutantAdapter):
    """A parameter in two units: the root's fully_shard does not see that the blocks' parameters
    were already claimed by their own units and shards them again (every parameter's shard twice in
    memory, gathered twice per forward). The modules keep pointing at the blocks' own parameters
    (the root's copies are never set on them), which train, so the numbers look right."""

    name = "mutant:nested_duplication"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import fully_shard

        model.to(device)
        owned = [(sub, name, p) for sub in model.modules() for name, p in sub._parameters.items() if p is not None]
        for unit in units:
            fully_shard(unit, process_group=group)
        inner = [p for _, p in sharded_params_of(model)]
        taken = {(id(o.module), o.name) for p in inner for o in p.owners}
        for sub, name, p in owned:
            if (id(sub), name) in taken:  # a unit's: made visible to the root again
                p._fsdp_claimed = False
                sub._parameters[name] = p
        wrapped = fully_shard(model, process_group=group)
        for p in wrapped._fsdp_state.params.params:
            if any((id(o.module), o.name) in taken for o in p.owners):
                p.set_on_modules = lambda param: None  # the duplicate: gathered and held, never used
        for p in inner:  # the root's fully_shard pointed the modules at its copies: the blocks' own again
            p.set_on_modules(p.sharded)
        return wrapped


class StaleShard(MutantAdapter):
    """The last rank all-gathers a stale copy of its shards: it caches the buffer it sends (as a
    param-dtype cast cache would) and never invalidates it after optimizer.step()."""

    name = "mutant:stale_shard"

    def mutate(self, wrapped):
        gather = collectives_module().all_gather_flat
        for _, g in param_groups_of(wrapped):
            if g.rank != g.world_size - 1 or g.world_size == 1:
                continue
            cache: dict[str, Tensor] = {}

            def gather_cached(out, shard, group, *args, cache=cache, **kwargs):
                if "shard" not in cache:
                    cache["shard"] = shard.detach().clone()
                return gather(out, cache["shard"], group, *args, **kwargs)

            rebind(g, "unshard", all_gather_flat=gather_cached)


class TieBroken(MutantAdapter):
    """Tied weights untied on wrapping (the head gets a copy of the embedding, as a wrapper that
    re-registers each module's parameters would do): each copy trains on its own gradient only."""

    name = "mutant:tie_broken"

    def wrap(self, model, units, *, group, device):
        head = getattr(model, "head", None)
        if head is not None and head.weight is getattr(getattr(model, "embed", None), "weight", None):
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
        return super().wrap(model, units, group=group, device=device)
