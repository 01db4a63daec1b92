"""FlatParamHandle: one flat, padded, sharded parameter standing for several original parameters.

Lifecycle per training step (W > 1):
    pre-forward   all-gather the shard into the full leaf tensor (made on first use, then refilled in
                  place); module attributes become views of it
    post-forward  free the full storage (reshard_after_forward)
    pre-backward  re-allocate and all-gather into the same storage (saved views see the data again)
    post-backward autograd accumulates every view's gradient into full.grad (one flat, padded tensor);
                  reduce-scatter it to the mean shard gradient, add it to shard.grad, free the full storage
                  (with gradient sync off, full.grad is kept, unreduced, for the next backward to add to)
                  HSDP (a replicate group): the shard group's sum, kept wide, is summed across the
                  replicas before the one division by R x S
At world size 1 with no dtype cast the shard *is* the full buffer: views are taken straight from the
parameter the optimizer owns, gradients accumulate into it by autograd, nothing is copied
(unless there are replicas to reduce with: then the full buffer is a copy, as at W > 1).
"""

from __future__ import annotations

import weakref
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_gather_flat, hybrid_reduce_mean, reduce_scatter_mean
from .mixed_precision import MixedPrecisionPolicy
from .sharding import FlatLayout, ParamSlot


class HandleState(Enum):
    SHARDED = auto()  # only the local shard holds data; the full buffer (if any) has no storage
    UNSHARDED = auto()  # the full buffer holds every rank's shard; module attributes are views into it


class Owner:
    """One (module, attribute) that refers to a slot; tied parameters have several owners."""

    __slots__ = ("module", "name", "fqn")

    def __init__(self, module: nn.Module, name: str, fqn: str):
        self.module, self.name, self.fqn = module, name, fqn


class FlatParamHandle:
    def __init__(self, entries: list[tuple[nn.Parameter, list[Owner]]], group, mp: MixedPrecisionPolicy,
                 replicate_group=None):
        first = entries[0][0]
        self.group = group  # the shard group: the layout, gathers, the first gradient reduction
        self.replicate_group = replicate_group  # HSDP: ranks holding this same shard; None if no replicas
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dtype, self.device, self.requires_grad = first.dtype, first.device, first.requires_grad
        self.param_dtype = mp.param_dtype or self.dtype
        # the gradient autograd produces has param_dtype; the default sums one step wider than it
        self.reduce_dtype = mp.reduce_dtype or _wider(self.param_dtype)
        self.layout = FlatLayout.build([(owners[0].fqn, tuple(p.shape)) for p, owners in entries], self.world_size)
        self.owners: list[list[Owner]] = [owners for _, owners in entries]  # per slot
        self._padding = self.layout.padding_mask_ranges(self.rank)
        # 1D, length layout.shard_numel, zero outside parameter elements
        shard = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        if not first.is_meta:
            with torch.no_grad():
                for (p, _), slot in zip(entries, self.layout.slots):
                    self._copy_into_shard(shard, slot, p.detach().reshape(-1))
        self.shard = nn.Parameter(shard, requires_grad=self.requires_grad)
        self.shard._fsdp_shard = True  # marks it for fully_shard of an ancestor: not an original parameter
        # the shard is the full buffer: no collective, no copy
        self.no_copy = self.world_size == 1 and self.param_dtype == self.dtype and replicate_group is None
        self.full: torch.Tensor | None = None  # 1D, padded; a leaf that autograd accumulates into
        self.state = HandleState.SHARDED
        self.sync_grads = True  # False: keep full.grad unreduced between backward passes (accumulation)

    # -- layout helpers -------------------------------------------------------------------------
    def _copy_into_shard(self, shard: torch.Tensor, slot: ParamSlot, flat_value: torch.Tensor) -> None:
        span = self.layout.overlap(slot, self.rank)
        if span is None:
            return
        lo = self.layout.rank_range(self.rank)[0]
        a, b = span
        shard[a - lo:b - lo].copy_(flat_value[a - slot.offset:b - slot.offset])

    def zero_padding_(self, flat_shard: torch.Tensor) -> None:
        for a, b in self._padding:
            flat_shard[a:b].zero_()

    # -- unshard / reshard ----------------------------------------------------------------------
    def unshard(self) -> None:
        """Gather the full parameters (forward) and point module attributes at views of them."""
        if self.state is HandleState.UNSHARDED:
            return
        # padding is re-zeroed before every gather, so no optimizer can leak values into it; it is
        # in no view, so the version counter (checked by autograd for saved views) may stay as it is
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.shard):
            self.zero_padding_(self.shard)
        if self.no_copy:
            self._set_views(self.shard)
        else:
            want_grad = self.requires_grad and torch.is_grad_enabled()
            if self.full is None or (want_grad and not self.full.requires_grad):
                full = torch.empty(self.layout.padded_numel, dtype=self.param_dtype, device=self.device)
                if want_grad:
                    full.requires_grad_(True)
                    # Looked up at each call: the leaf lives for many steps. Through a weak reference:
                    # a tensor's hooks are held from C++, where the garbage collector cannot see
                    # them, so a hook holding the handle (which holds the leaf) would be a cycle
                    # never collected, keeping every shard alive after the model is dropped.
                    handle = weakref.ref(self)
                    full.register_post_accumulate_grad_hook(lambda t: handle()._post_backward(t))
                self.full = full
            # else the leaf is reused: a unit called twice in one forward (or forwards before one
            # backward) leaves saved views into it; refilling one storage makes them all valid again
            self._fill_full()
            self._set_views(self.full)
        self.state = HandleState.UNSHARDED

    def unshard_for_backward(self) -> None:
        """Refill the storage freed after forward; the views saved by autograd see the data again."""
        if self.state is HandleState.UNSHARDED or self.full is None:
            return
        self._fill_full()
        self.state = HandleState.UNSHARDED

    def _fill_full(self) -> None:
        """(Re)allocate the full buffer's storage and all-gather into it, keeping its version."""
        full = self.full
        nbytes = full.numel() * full.element_size()
        if full.untyped_storage().nbytes() != nbytes:
            full.untyped_storage().resize_(nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
            all_gather_flat(full, self.shard.detach().to(self.param_dtype), self.group)

    def reshard(self) -> None:
        """Free the full parameters; only this rank's shard stays."""
        if self.state is HandleState.SHARDED:
            return
        if self.full is not None:
            self.full.untyped_storage().resize_(0)
        self.state = HandleState.SHARDED

    def _set_views(self, full: torch.Tensor) -> None:
        for slot, owners in zip(self.layout.slots, self.owners):
            view = full[slot.offset:slot.end].view(slot.shape)
            for owner in owners:
                setattr(owner.module, owner.name, view)

    # -- gradients ------------------------------------------------------------------------------
    def _post_backward(self, full: torch.Tensor) -> None:
        if not self.sync_grads:  # accumulating: the next backward adds to full.grad, one reduction at the end
            self.reshard()
            return
        grad, full.grad = full.grad, None
        if self.replicate_group is None:
            reduced = reduce_scatter_mean(grad, self.group, self.reduce_dtype).to(self.dtype)
        else:
            reduced = hybrid_reduce_mean(grad, self.group, self.replicate_group, self.reduce_dtype).to(self.dtype)
        self.zero_padding_(reduced)
        if self.shard.grad is None:
            self.shard.grad = reduced
        else:
            self.shard.grad += reduced
        self.reshard()  # the leaf stays (storage freed); the next forward refills it

    # -- whole-parameter access (state dicts) ---------------------------------------------------
    def gather_full(self) -> torch.Tensor:
        """All-gather the shard in its own dtype (collective): 1D, padded."""
        out = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            all_gather_flat(out, self.shard.detach(), self.group)
        return out

    def load_full(self, slot: ParamSlot, value: torch.Tensor) -> None:
        with torch.no_grad():
            self._copy_into_shard(self.shard, slot, value.detach().reshape(-1).to(self.shard))


def _wider(dtype: torch.dtype) -> torch.dtype:
    """Default reduction dtype: one step wider than the gradient (fp32 -> fp64, 16-bit -> fp32)."""
    return {torch.float32: torch.float64, torch.float16: torch.float32, torch.bfloat16: torch.float32}.get(dtype, dtype)
