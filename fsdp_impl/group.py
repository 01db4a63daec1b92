"""ParamGroup: the sharded parameters of one unit and the two collectives that move them.

    unshard       copy every parameter's padded shard into one flat buffer (cast to param_dtype),
                  ONE all-gather of it over the shard group, copy each rank's rows out into each
                  unsharded parameter (``split_with_sizes_copy``); the modules point at them.
                  Asynchronous for prefetching: ``unshard(async_op=True)`` issues the all-gather,
                  ``wait_unshard`` waits for it and does the copy-out
    reshard       the modules point at the sharded DTensors again; the unsharded storage is freed.
                  After forward with a post-forward group of g ranks (``reshard_after_forward=g``), each rank
                  first keeps the W / g ranks' chunks its place in that group stands for (see [Note:
                  resharding to a smaller group]); the next unshard all-gathers those over the g ranks only
    reduce_grads  the unsharded gradients, each cut into W chunks of c rows (zero rows padding the
                  last), laid out chunk by chunk in ONE buffer (``torch._chunk_cat``): chunk r
                  holds every parameter's rows for rank r. ONE reduction of it (collectives.py:
                  an all-to-all in the gradient's dtype, a sum in rank order in reduce_dtype, one
                  division, then the cast to the sharded dtype); each parameter's rows of this
                  rank's chunk become (or are added to) its sharded gradient

One collective per dtype, in practice one per unit: every parameter of a unit has the same
param_dtype under a MixedPrecisionPolicy, and models seldom mix dtypes otherwise. Frozen
parameters are gathered with the others and never reduced; a parameter that got no gradient in a
backward is left out of that reduction (every rank must agree on which: the model's use of its
parameters may not depend on the rank's data).

[Note: resharding to a smaller group] ``reshard_after_forward=g`` (1 < g < W, g dividing W): the post-forward
group is this rank's g consecutive ranks of the shard group (ranks j x g .. j x g + g - 1, FSDP2's
``mesh.view(-1, g)``). Member i of it keeps, between forward and backward, the padded chunks of the W / g
shard-group ranks i x W / g .. (i + 1) x W / g - 1 (every parameter's, packed as the all-gather packs them:
rank by rank). Gathering those blocks over the g members in group order yields the W chunks in rank order,
the very layout the all-gather over W ranks yields, so both are copied out alike. A rank holds 1 / g of
the unit between forward and backward (not 1 / W), and backward's all-gather moves (g - 1) / g of it on
the wire within the group, not (W - 1) / W across the shard group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, holds_exactly, hybrid_reduce_mean, reduce_scatter_mean, reduce_scatter_tree
from .mixed_precision import MixedPrecisionPolicy
from .param import ShardedParam, ShardState
from .tree import TreeSum


class ParamGroup:
    def __init__(
        self, params: list[ShardedParam], group, replicate_group, mp: MixedPrecisionPolicy, post_forward_group=None
    ):
        self.params = params
        self.group = group  # the shard group: gathers and the first gradient reduction
        self.replicate_group = replicate_group  # HSDP: ranks holding the same shards; None if no replicas
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.mp = mp
        self.state = ShardState.SHARDED
        self.sync_grads = True  # False: keep the unsharded gradients unreduced between backward passes
        self._pending: list | None = None  # an issued, not yet completed unshard (prefetch)
        # reshard_after_forward=g: the g ranks that regather the unit for backward (None: the shard group)
        self.post_forward_group = post_forward_group
        self._kept: dict | None = None  # after forward: param_dtype -> 1D, (W / g) x the unit's padded shards
        # batch-invariant training (invariant.py): each parameter's micro-batch gradients, summed in the fixed tree
        self._trees: dict | None = None
        self._tree_across = True
        self.keep_gathered = False  # no reshard after backward (invariant.py: between a step's micro-batches)

    # -- unshard / reshard ----------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather every parameter of the unit (collective) and point the modules at the result.
        With `async_op` (prefetching) the all-gathers are only issued; ``wait_unshard`` (or any
        later ``unshard`` / ``reshard``) completes them: until then the modules keep their shards."""
        if self.state is ShardState.UNSHARDED or self._pending is not None:
            if not async_op:
                self.wait_unshard()
            return
        self._pending = []
        kept, self._kept = self._kept, None
        for dtype, params in buckets(self.params, lambda p: p.param_dtype):
            sizes = [p.shard_numel for p in params]
            if self.world_size == 1:  # nothing to exchange: wait_unshard copies the shards straight out
                self._pending.append((params, sizes, None, None, None))
                continue
            total = sum(sizes)
            received = torch.empty(self.world_size * total, dtype=dtype, device=params[0].device)
            if kept is not None:  # the blocks kept after forward, over the post-forward group (see the note)
                send = kept[dtype]
                work = all_gather_flat(received, send, self.post_forward_group, async_op=True)
                self._pending.append((params, sizes, send, received, work))
                continue
            send = torch.empty(total, dtype=dtype, device=params[0].device)  # 1D: every padded shard
            with torch.no_grad():
                copy_all(list(send.split(sizes)), [p.padded for p in params])
            # rank r's flat shards at [r * total, ...)
            work = all_gather_flat(received, send, self.group, async_op=True)
            self._pending.append((params, sizes, send, received, work))
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Complete an issued unshard: wait for its all-gathers, copy each rank's rows out into the
        unsharded parameters, point the modules at them. A no-op when none is in flight."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        for params, sizes, _send, received, work in pending:
            if work is not None:
                work.wait()
            outs = [p.alloc_unsharded() for p in params]  # each its W chunks (ShardedParam.by_rank)
            # the unsharded parameters keep their version: autograd saved them in forward, and
            # refilling the same storage for backward is no change to what it saved
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
                if received is None:  # world size 1: one copy (and cast to param_dtype) per parameter
                    copy_all([o.view(-1) for o in outs], [p.padded for p in params])
                elif all(p.dim == 0 for p in params):
                    torch.split_with_sizes_copy(received.view(self.world_size, -1), sizes, dim=1, out=outs)
                else:  # a parameter sharded on another dim: its chunks go into a strided view of it
                    for out, part in zip(outs, received.view(self.world_size, -1).split(sizes, dim=1)):
                        out.copy_(part.view(out.shape))
            # freed now, not when the backend lets go of its work: gloo's thread may still hold it
            # after wait() returns, and the next unit's gather would then find this one's buffers
            for buffer in (received, _send):
                if buffer is not None:
                    buffer.untyped_storage().resize_(0)
        for p in self.params:
            p.to_unsharded()
        self.state = ShardState.UNSHARDED

    @property
    def gathering(self) -> bool:
        """True between an asynchronous unshard and its completion."""
        return self._pending is not None

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded parameters; only this rank's shards stay. An unshard still in flight
        (a prefetch nobody used) is completed first: its collectives were issued on every rank.
        `after_forward` with a post-forward group: keep this rank's block for the group's regather."""
        self.wait_unshard()
        if self.state is ShardState.SHARDED:
            if not after_forward:
                self._kept = None
            return
        if after_forward and self.post_forward_group is not None:
            self._kept = self._post_forward_blocks()
        for p in self.params:
            p.to_sharded()
        self.state = ShardState.SHARDED

    def _post_forward_blocks(self) -> dict:
        """param_dtype -> this rank's block of the unit for the post-forward group (1D, copied out of the
        unsharded parameters: the chunks of the W / g ranks it stands for, rank by rank, each packing every
        parameter's padded chunk as the all-gather packs it)."""
        per = self.world_size // dist.get_world_size(self.post_forward_group)
        lo = dist.get_rank(self.post_forward_group) * per
        kept = {}
        with torch.no_grad():
            for dtype, params in buckets(self.params, lambda p: p.param_dtype):
                sizes = [p.shard_numel for p in params]
                block = torch.empty(per, sum(sizes), dtype=dtype, device=params[0].device)
                for part, p in zip(block.split(sizes, dim=1), params):
                    part.copy_(p.alloc_unsharded()[lo : lo + per].reshape(per, -1))
                kept[dtype] = block.view(-1)
        return kept

    # -- gradients ------------------------------------------------------------------------------
    def reduce_grads(self) -> None:
        """Reduce every unsharded gradient of the unit (with what passes without sync held) to the mean over
        all ranks (collective) and add this rank's rows to the sharded gradients; the unsharded gradients are
        released."""
        invariant = self._trees is not None and self._tree_across
        taken = self._take_grads()
        todo = list(taken)
        if self.world_size == 1 and self.replicate_group is None and not invariant:
            # one rank: the mean is the gradient itself, cast where the policy says; each becomes (or is added
            # to) the sharded gradient without the flat reduce buffer, a copy of the whole unit's gradients
            for p in todo:
                grad = taken.pop(p)
                mean = reduce_scatter_mean(
                    grad.reshape(-1), self.group, self.mp.reduce_dtype or wider(grad.dtype), p.dtype
                )
                p.add_reduced_grad(mean.to(p.dtype))
            return
        for dtype, params in buckets(todo, lambda p: taken[p].dtype):
            grads = [p.chunks(taken.pop(p)) for p in params]
            # (W, sum of c x row): chunk r is every parameter's rows for rank r, zero rows padding
            send = torch._chunk_cat(grads, dim=0, num_chunks=self.world_size)
            del grads
            reduce_dtype = self.mp.reduce_dtype or wider(dtype)
            if self._trees is not None and not invariant:  # replicated trees: W identical sums, averaged exactly
                reduce_dtype = wider(dtype)  # (summed one by one in fp32, 3 x g already rounds)
            targets = {p.dtype for p in params}  # the sharded gradients' dtype: one in practice
            out_dtype = targets.pop() if len(targets) == 1 else None  # rounded to it as it is divided
            if invariant:  # the tree's levels across ranks; the loss was already scaled by 1 / L (invariant.py)
                reduced = reduce_scatter_tree(send.view(-1), self.group, dtype)
            elif self.replicate_group is None:
                reduced = reduce_scatter_mean(send.view(-1), self.group, reduce_dtype, out_dtype)
            else:
                reduced = hybrid_reduce_mean(send.view(-1), self.group, self.replicate_group, reduce_dtype, out_dtype)
            del send
            for (_target, part), ps in _cast_by_target(reduced, params):
                for p, seg in zip(ps, part):
                    p.add_reduced_grad(seg)

    # -- batch-invariant training (invariant.py) -------------------------------------------------
    def begin_tree(self, across_ranks: bool = True) -> None:
        """From now on each backward's gradients go into the fixed binary tree (none may be held already);
        `across_ranks`: the reduction sums the ranks' trees in the tree's upper levels (split data), else it
        averages them as usual (replicated data: W identical sums)."""
        if any(p.unsharded_grad() is not None or p.held_grad is not None for p in self.params):
            raise RuntimeError(
                "batch-invariant step: gradients from an earlier backward are still held; reduce "
                "them first (a backward with gradient sync on)"
            )
        self._trees = {p: TreeSum() for p in self.params if p.requires_grad}
        self._tree_across = across_ranks

    def end_tree(self) -> None:
        self._trees = None

    def _tree_dtype(self, grad: torch.Tensor) -> torch.dtype:
        return self.mp.reduce_dtype if self.mp.reduce_dtype is not None else grad.dtype

    def _push_trees(self) -> None:
        """This backward's gradient of every parameter becomes its tree's next leaf (None: a zero, for a parameter
        the micro-batch left without one). A unit whose parameters got no gradient at all pushes nothing: the
        backward did not reach it, or its gradients were already taken (the final callback's second look)."""
        grads = {p: p.unsharded_grad() for p in self._trees}
        if all(g is None for g in grads.values()):
            return
        for p, grad in grads.items():
            if grad is not None:
                p.unsharded.grad = None
                grad = grad.to(self._tree_dtype(grad))
            self._trees[p].push(grad)

    def hold_grads(self) -> None:
        """A backward pass with the reduction switched off: where the policy reduces in a wider dtype than
        the unsharded gradient (bf16 compute, fp32 reduction), each unsharded gradient is added into an
        accumulator of the reduction's dtype and released, so micro-batches add up as the reduction would
        (in fp32), not rounded to bf16 at every pass. Elsewhere autograd's accumulation is already that."""
        if self._trees is not None:
            self._push_trees()
            return
        reduce_dtype = self.mp.reduce_dtype
        for p in self.params:
            grad = p.unsharded_grad()
            if (
                grad is None
                or reduce_dtype is None
                or not holds_exactly(reduce_dtype, grad.dtype)
                or reduce_dtype == grad.dtype
            ):
                continue
            p.unsharded.grad = None
            p.held_grad = grad.to(reduce_dtype) if p.held_grad is None else p.held_grad.add_(grad)

    def _take_grads(self) -> dict:
        """parameter -> the gradient to reduce: its held accumulator plus this pass's unsharded gradient (added
        in the accumulator's dtype), both released from the parameter."""
        if self._trees is not None:  # the last micro-batch: its leaf, then each tree's sum
            self._push_trees()
            if not any(len(tree) for tree in self._trees.values()):
                return {}
            return {p: total for p, tree in self._trees.items() if (total := tree.result()) is not None}
        out = {}
        for p in self.params:
            grad, held = p.unsharded_grad(), p.held_grad
            if not p.requires_grad or (grad is None and held is None):
                continue
            if grad is not None:
                p.unsharded.grad = None
            p.held_grad = None
            out[p] = grad if held is None else held if grad is None else held.add_(grad)
        return out


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i: one foreach copy where all are on one device, else one copy each
    (offloaded shards: host to device, asynchronous from pinned memory, ordered before the collective that
    reads them by the device's stream)."""
    if all(s.device == d.device for s, d in zip(src, dst)):
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=s.is_pinned())


def buckets(params: list[ShardedParam], key) -> list[tuple[torch.dtype, list[ShardedParam]]]:
    """params grouped by key(p), in order of first appearance, each group in params' order."""
    out: dict = {}
    for p in params:
        out.setdefault(key(p), []).append(p)
    return list(out.items())


def _cast_by_target(reduced: torch.Tensor, params: list[ShardedParam]):
    """(target dtype, the per-parameter padded chunks of `reduced` cast to it), params of that dtype.
    One cast per sharded dtype: in practice one for the whole unit."""
    segments = dict(zip(map(id, params), reduced.split([p.shard_numel for p in params])))
    out = []
    for dtype, ps in buckets(params, lambda p: p.dtype):
        parts = [segments[id(p)] for p in ps]
        if reduced.dtype != dtype:
            flat = torch.cat(parts).to(dtype) if len(ps) < len(params) else reduced.to(dtype)
            parts = list(flat.split([p.shard_numel for p in ps]))
        out.append(((dtype, parts), ps))
    return out


def wider(dtype: torch.dtype) -> torch.dtype:
    """Default reduction dtype: one step wider than the gradient (fp32 -> fp64, 16-bit -> fp32)."""
    return {torch.float32: torch.float64, torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(dtype, dtype)
