"""Per-rank memory: training state held (`state_bytes`) and peak over one step (`PeakMemory`).

Bytes of a tensor are the bytes of the storage it lives in (``untyped_storage().nbytes()``), each
storage counted once: tied weights, parameters that are views into one flat buffer (FSDP1,
``fsdp_impl``) and the padded shard behind an FSDP2 DTensor all count as the memory actually held,
padding included; a storage freed by ``resize_(0)`` counts 0. DTensors count their local shard.

Categories (both functions use the same names):
    params           parameters (sharded and, during the step, unsharded copies / all-gather output,
                     unless what was gathered was computed from gradients: then grads)
    grads            gradients (sharded and unsharded, reduce-scatter input)
    optimizer_state  tensors in ``optimizer.state`` (exp_avg, exp_avg_sq, momentum_buffer, step)
    activations      tensors made in forward, and temporaries of backward (activation gradients)
    other            buffers, inputs, external tensors; on CUDA also device memory the tracker
                     cannot see (allocator rounding, workspaces, NCCL), so categories sum to peak
    peak             the peak total; the other five are the breakdown AT that moment
Buffers are not part of `state_bytes` (ZeRO-3 does not shard them).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import (
    _TOTAL_KEY,
    MemTracker,
    _MemRefType,
    _UpdateType,
    _WeakRefInfo,
    get_untyped_storages,
)
from torch.utils._pytree import tree_leaves

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["state_bytes", "state_tensors", "optimizer_list", "PeakMemory", "CATEGORIES", "local_tensor"]

CATEGORIES = ("params", "grads", "optimizer_state", "activations", "other")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int]:
    st = local_tensor(t).untyped_storage()
    return st._cdata, st.nbytes()


def _count(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        key, nbytes = _storage_key_and_bytes(t)
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def optimizer_list(optimizer: Any) -> list[Any]:
    """One optimizer, several (a list or tuple), or None, as a list."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def state_tensors(model: nn.Module, optimizer: Any) -> dict[str, list[torch.Tensor]]:
    """The training state by category: {"params", "grads", "optimizer_state"}.

    ``optimizer``: one optimizer or several (an optimizer wrapper and the optimizer inside it).
    Parameters are those of ``model`` plus any an optimizer holds that the model does not list
    (e.g. a flat parameter); grads are theirs; optimizer state is the tensors in every
    optimizer's ``state``."""
    optimizers = optimizer_list(optimizer)
    params = list(model.parameters())
    known = {id(p) for p in params}
    for opt in optimizers:  # an object that only looks like an optimizer may lack either attribute
        for g in getattr(opt, "param_groups", ()):
            for p in g["params"]:
                if id(p) not in known:
                    known.add(id(p))
                    params.append(p)
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer_state": optimizer_state_tensors(optimizers),
    }


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors in the ``state`` of one optimizer or several (none for an object without one)."""
    return [
        v
        for opt in optimizer_list(optimizer)
        for s in getattr(opt, "state", {}).values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]


def state_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes THIS rank holds now in `state_tensors`' categories, each storage once: a storage
    already counted in an earlier category is not counted again."""
    seen: set[int] = set()
    return {cat: _count(tensors, seen) for cat, tensors in state_tensors(model, optimizer).items()}


# Tracker reference type (its ``.value``) -> our category; anything unlisted is "other".
_CATEGORY_OF = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "All Gather": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",
    "Optstate": "optimizer_state",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Temp": "activations",
}
_C10D = torch.ops.c10d
_GATHER_BASE, _SCATTER_BASE = _C10D._allgather_base_.default, _C10D._reduce_scatter_base_.default
_GATHERS = {_GATHER_BASE, _C10D.allgather_into_tensor_coalesced_.default}
_SCATTERS = {_SCATTER_BASE, _C10D.reduce_scatter_tensor_coalesced_.default}


class _StorageMap:
    """storage -> value for the storages alive, what MemTracker keeps in a ``WeakIdKeyDictionary`` (``_WINFO``) and
    looks up several times for every operation. Keyed here by the storage's own address (``_cdata``, unique among
    live storages), with a weak reference that drops the entry when the storage dies and proves, at each lookup,
    that the entry is this storage's and not a dead one's at the same address: a dict lookup, where the weak-keyed
    dictionary builds a Python key object and compares it in Python (a fifth of the measured step's time,
    reports/performance.md#the-measured-step). A tensor's storage is one Python object for as long as it lives
    (torch keeps it), so its address and its object name it alike."""

    __slots__ = ("_by_key",)

    def __init__(self) -> None:
        self._by_key: dict[int, tuple[weakref.ref, Any]] = {}

    def entry(self, st: Any) -> tuple[weakref.ref, Any] | None:
        """(the weak reference, the value) kept for `st`, or None."""
        entry = self._by_key.get(st._cdata)
        return entry if entry is not None and entry[0]() is st else None

    def get(self, st: Any, default: Any = None) -> Any:
        entry = self.entry(st)
        return default if entry is None else entry[1]

    def __contains__(self, st: Any) -> bool:
        return self.entry(st) is not None

    def __setitem__(self, st: Any, value: Any) -> None:
        self.add(st, value)

    def add(self, st: Any, value: Any, on_death: Any = None) -> None:
        """Keep `value` for `st`; `on_death(value)` too (if given) when the storage dies."""
        key, by_key = st._cdata, self._by_key

        def drop(ref: weakref.ref) -> None:
            if by_key.get(key, (None,))[0] is ref:
                del by_key[key]
            if on_death is not None:
                on_death(value)

        by_key[key] = (weakref.ref(st, drop), value)

    def pop(self, st: Any, default: Any = None) -> Any:
        entry = self.entry(st)
        if entry is None:
            return default
        del self._by_key[st._cdata]
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_key)

    def clear(self) -> None:
        self._by_key.clear()


class _GlobalPeakOnly:
    """Keeps only the global peak snapshot. MemTracker also refreshes a per-module peak for every
    op, a loop over all modules seen: O(ops x modules), 3/4 of the time of a GPT-2-medium step
    under FakeTensorMode. Module-wise snapshots (not used here) lose their peak entries.

    Calls `_on_moment` (a unit timeline's `sample`) at the moments where an implementation changes which units
    it holds gathered (harness.measure.timeline): each module's forward and backward, entered and left, and each
    collective."""

    _on_moment: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the reference types as a tuple: MemTracker builds a device's zeroed snapshot from them at every update
        # (its default argument, evaluated whether needed or not), and an enum class iterates slowly
        self._ref_class = tuple(self._ref_class)  # type: ignore[has-type]
        self._WINFO = _StorageMap()

    def _moment(self, *_: Any) -> None:
        if self._on_moment is not None:
            self._on_moment()

    def get_tracker_snapshot(self, type: str = "current") -> dict:  # noqa: A002 (MemTracker's name)
        """MemTracker's, copied without deepcopy (the module hooks take one at every module's forward and
        backward): a snapshot is {device: {reference type: bytes}}, ints only."""
        if type not in ("current", "peak"):
            raise ValueError(f"Invalid type {type}")
        snap = self._curr_mem_snap if type == "current" else self._peak_mem_snap  # type: ignore[attr-defined]
        return {dev: dict(by_ref) for dev, by_ref in snap.items()}

    def forget(self) -> None:
        """After the window: drop the weak-keyed records of the storages and modules it saw (the peak snapshot is
        kept apart). Left to the collector, a dead tracker's weak references on a model that a later window tracked
        crashed the process in CPython's weakref clearing when the model was freed (two windows on one model)."""
        self._WINFO.clear()  # type: ignore[attr-defined]
        self.memory_tracking.clear()  # type: ignore[attr-defined]

    def _run(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """(the operation's result, whether its tensors are the window's own): a wait under a fake mode answered with
        its input as MemTracker does; an operation under a fake mode other than the window's is DTensor's sharding
        propagation, not memory. The fake mode is looked up by its dispatch key (torch._guards.active_fake_mode
        walks the mode stack)."""
        fake = _active_fake_mode(_FAKE)
        res = args[0] if func is _WAIT_TENSOR and fake is not None else func(*args, **kwargs)
        return res, fake is getattr(self, "_fake_mode_on_entry", None)

    def _track_made(self, results: list[torch.Tensor], kinds: Any) -> None:
        """An operation's results tracked as what the step makes now (`kinds`: the tracker's reference types):
        optimizer state within the optimizer's step, temporaries in backward (outside activation checkpointing's
        recomputation), activations otherwise; then the peak."""
        opt, backward = self._in_opt, self._mod_tracker.is_bw  # type: ignore[attr-defined]
        reftype = kinds.OPT if opt else kinds.TEMP if backward and not self._in_ac else kinds.ACT  # type: ignore[attr-defined]
        for t in results:
            self._track(reftype, t)
        self._update_peak_stats(None)

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        """MemTracker's, reading a plain tensor's storage directly (its `get_untyped_storages` looks for a wrapper
        subclass first, for every result of every operation), and a new storage's record made with one weak
        reference, whose death both drops the record and takes its bytes off (MemTracker's makes two)."""
        for st in _storages(t):
            entry = self._WINFO.entry(st)  # type: ignore[attr-defined]
            if entry is not None:
                winfo = entry[1][0]
                if winfo.size != st.size():
                    old = winfo.mem_consumed
                    winfo.update_mem_consumed(st)
                    self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old)  # type: ignore[attr-defined]
                return
            winfo = _WeakRefInfo(st.size(), 1, t.device, reftype)  # an untyped storage's element is a byte
            # (record, None): MemTracker's own methods unpack an entry as (record, its weak reference); this entry's
            # weak reference is the map's
            self._WINFO.add(st, (winfo, None), self._died)  # type: ignore[attr-defined]
            nbytes = winfo.mem_consumed
            if nbytes > 0:
                snap = self._curr_mem_snap.get(winfo.device)  # type: ignore[attr-defined]
                if snap is None:
                    self._update_snap(_UpdateType.ADD, winfo)  # type: ignore[attr-defined]
                else:
                    snap[reftype] += nbytes
                    snap[_TOTAL_KEY] += nbytes

    def _died(self, record: tuple) -> None:
        """A storage recorded by `_track` died: its bytes off the current snapshot (MemTracker's delete callback)."""
        winfo = record[0]
        if winfo.mem_consumed > 0:
            self._update_snap(_UpdateType.DEL, winfo)  # type: ignore[attr-defined]

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            if self._peak_mem.get(dev, 0) < snap["Total"]:  # type: ignore[attr-defined]
                self._peak_mem[dev] = snap["Total"]  # type: ignore[attr-defined]
                self._peak_mem_snap[dev] = dict(snap)  # type: ignore[attr-defined]


class _CollectiveAwareTracker(_GlobalPeakOnly, MemTracker):
    """MemTracker that files all-gather outputs under params (grads where the gathered data came from
    gradients: an all-reduce spelled as reduce-scatter + all-gather) and reduce-scatter inputs under
    grads, so any ZeRO-3 implementation's unsharded buffers are attributed without knowing it.
    It also skips gradient hooks on parameters that are not leaves during forward (FSDP1 with
    ``use_orig_params=True`` makes them views of the flat parameter), which MemTracker rejects."""

    def __init__(self) -> None:
        super().__init__()
        self._gradient_data = _StorageMap()  # storage -> True

    # The module tracker's hooks (MemTracker registers these four with it): a moment at each. MemTracker's own also
    # keep per-module statistics (a snapshot copied at each module's forward and backward, its inputs' and
    # outputs' bytes) that nothing here reads; what the peak needs of them is kept: a module's parameters and
    # buffers tracked at its first forward (gradient hooks included), and the activation-checkpointing region
    # (a module run again in backward) whose recomputed tensors are activations, not temporaries.
    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        if module not in self.memory_tracking:  # type: ignore[attr-defined]
            self.memory_tracking[module] = True  # type: ignore[attr-defined]
            self._track_module_params_and_buffers(module, install_grad_hooks=True)
        elif self._mod_tracker.is_bw and self._ac_mod is None:  # type: ignore[attr-defined,has-type]
            self._ac_mod, self._in_ac = weakref.ref(module), True
        self._moment()

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:  # type: ignore[attr-defined]
            self._ac_mod, self._in_ac = None, False
        self._moment()

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        self._moment()

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        self._moment()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        param_memory = buffer_memory = 0
        for p in module.parameters():
            winfos = self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if p.is_leaf and p.grad is not None:  # .grad of a non-leaf warns
                self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)
            if (
                install_grad_hooks
                and p.is_leaf
                and p.requires_grad
                and self._param_to_grad_hook_handles.get(p, None) is None
            ):
                self._param_to_grad_hook_handles[p] = (
                    p.register_hook(grad_hook),
                    p.register_post_accumulate_grad_hook(lambda q: grad_hook(q.grad)),
                )
        for b in module.buffers():
            winfos = self._update_and_maybe_create_winfos(b, _MemRefType.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # MemTracker's own dispatch, without rebuilding the result's structure to visit its tensors
        # (tree_map_only) and without a second Python frame per operation: both cost a large share of the
        # measured step (reports/performance.md#the-measured-step)
        if DTensor is not None and DTensor in types:
            return NotImplemented  # DTensor lowers to local operations first; those come back here
        kwargs = kwargs or {}
        res, real = self._run(func, args, kwargs)
        results = tensors_in(res)
        if real:
            self._track_made(results, _MemRefType)
        if not _writes_arguments(func):
            # most operations: they write their results alone (new storages, or views of what they read) and read
            # every tensor argument. A result holds gradient data when an argument does; otherwise it is new and
            # unmarked, or a view of an argument that holds none: nothing to mark.
            if self._any_gradient_data(args) or (kwargs and self._any_gradient_data(kwargs.values())):
                self._mark_gradient_data(results, True)
        else:
            outputs, inputs = _written_and_read(func, args, kwargs, results)
            from_grads = func in _SCATTERS or any(self._holds_gradient_data(t) for t in inputs)
            if func in _GATHERS:  # what is gathered from gradient data is a gradient, not a parameter
                ref = _MemRefType.GRAD if from_grads else _MemRefType.PARAM
                for t in tensors_in(args[0]):
                    self._update_and_maybe_create_winfos(t, ref)
            elif func in _SCATTERS:
                for t in tensors_in(args[1]):
                    self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)
            self._mark_gradient_data(outputs, from_grads)
        if func.namespace in _COLLECTIVES:
            self._moment()
        return res

    def forget(self) -> None:
        super().forget()
        self._gradient_data.clear()

    # Gradient provenance. An all-gather is filed under params unless what it gathers was computed from
    # gradients: an all-reduce spelled as reduce-scatter + all-gather (fsdp_impl's HSDP replica exchange)
    # gathers a reduced gradient. A storage holds gradient data when the last operation that wrote it
    # read a gradient or gradient data; parameters, buffers and optimizer state are never re-marked (an
    # optimizer step writes parameters from gradients; they stay parameters). The mark is kept on the
    # tracker's own record of the storage (one lookup an operand: this runs for every operation), and for a
    # storage the tracker has no record of in `_gradient_data`.
    def _holds_gradient_data(self, t: torch.Tensor) -> bool:
        untracked = self._gradient_data
        for st in _storages(t):
            entry = self._WINFO.entry(st)
            if entry is not None:
                winfo = entry[1][0]
                if winfo.reftype is _MemRefType.GRAD or getattr(winfo, _FROM_GRADS, False):
                    return True
            if untracked and st in untracked:
                return True
        return False

    def _any_gradient_data(self, arguments: Iterable[Any]) -> bool:
        """Whether a tensor among `arguments` (an operation's, each a tensor, a flat sequence, anything else) holds
        gradient data (`_holds_gradient_data`). A tensor and a scalar are read here without `tensors_in`'s list: the
        same answer as `any(... for a in arguments for t in tensors_in(a))`, sooner on this path of every operation
        (reports/performance.md#the-measured-step)."""
        holds = self._holds_gradient_data
        for a in arguments:
            if isinstance(a, torch.Tensor):
                if holds(a):
                    return True
            elif isinstance(a, (list, tuple, dict)) and any(holds(t) for t in tensors_in(a)):
                return True
        return False

    def _mark_gradient_data(self, outputs: list[torch.Tensor], from_grads: bool) -> None:
        untracked = self._gradient_data
        for t in outputs:
            for st in _storages(t):
                winfo, _ = self._WINFO.get(st, (None, None))
                if winfo is None:
                    if from_grads:
                        untracked[st] = True
                    elif untracked:
                        untracked.pop(st, None)
                    continue
                if winfo.reftype in _STATE_REFS:
                    continue
                setattr(winfo, _FROM_GRADS, from_grads)
                if untracked:  # marked before the tracker recorded it
                    untracked.pop(st, None)


_FROM_GRADS = "harness_from_gradients"  # the mark's attribute on the tracker's record of a storage
_STATE_REFS = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.OPT)
_COLLECTIVES = ("c10d", "_c10d_functional")  # operator namespaces of the collectives and their waits
_OVERWRITTEN = {torch.ops.aten.copy_.default, torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar}
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_active_fake_mode, _FAKE = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE
_PLAIN = (torch.Tensor, nn.Parameter)  # tensors whose storage is their own (no wrapper subclass to unflatten)
_SCALARS = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in an operation's argument or result. Every operation of the measured step comes here several
    times: a flat sequence (a size, a list of tensors) and a scalar are read directly, anything nested through
    the pytree (which costs several times as much)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        found = []
        for v in x:
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (list, tuple, dict)):
                break
        else:
            return found
    elif x is None or isinstance(x, _SCALARS):
        return []
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _storages(t: torch.Tensor) -> Iterable[torch.UntypedStorage]:
    """The storages behind `t`: its own, or a wrapper subclass's inner tensors' (get_untyped_storages)."""
    return (t.untyped_storage(),) if type(t) in _PLAIN else get_untyped_storages(t)


# per operator: (position, name, written, read) of each argument (_written_and_read)
_ARGUMENTS: dict[Any, list[tuple[int, str, bool, bool]]] = {}


def _arguments(func) -> list[tuple[int, str, bool, bool]]:
    found = _ARGUMENTS.get(func)
    if found is None:
        found = []
        for i, a in enumerate(func._schema.arguments):
            is_write = a.alias_info is not None and a.alias_info.is_write
            found.append((i, a.name, is_write, not is_write or (not a.is_out and func not in _OVERWRITTEN)))
        _ARGUMENTS[func] = found
    return found


def _writes_arguments(func) -> bool:
    """Whether an aten (or other schema'd) operation writes an argument (in place, ``out=``); c10d's collectives
    mark nothing in their schemas and count as writing (`_written_and_read`)."""
    found = _WRITES.get(func)
    if found is None:
        found = _WRITES[func] = func.namespace == "c10d" or any(w for _, _, w, _ in _arguments(func))
    return found


_WRITES: dict[Any, bool] = {}


def _written_and_read(
    func, args: tuple, kwargs: dict, results: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the tensors an operation wrote, the tensors it read), given the tensors of its result. An aten operation
    writes its results and the arguments its schema marks as written (``out=``, in-place ``self``); it reads
    every other tensor argument and an in-place ``self`` (except where it overwrites it whole: copy_, zero_,
    fill_). The c10d collectives mark nothing in their schemas: those with an input argument (all-gather,
    reduce-scatter, all-to-all) write their first argument from their second; the others (all-reduce,
    broadcast) work in place on their first."""
    if func.namespace == "c10d":
        first = tensors_in(args[0]) if args else []
        second = tensors_in(args[1]) if len(args) > 1 else []
        return (first, second) if second else (first, list(first))
    written, read = list(results), []
    for i, name, is_write, reads in _arguments(func):
        tensors = tensors_in(args[i] if i < len(args) else kwargs.get(name))  # none in a scalar or None
        if is_write:
            written += tensors
        if reads:
            read += tensors
    return written, read


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


class PeakMemory:
    """Context manager around ONE training step in a rank; `result()` gives peak bytes by category.

    CPU (and any device): a dispatch-mode tracker (torch's ``FSDPMemTracker`` for an FSDP2 root,
    else ``MemTracker`` taught about c10d all-gather / reduce-scatter buffers) sees every tensor
    the step creates plus the model's parameters, buffers, gradients and the optimizer's state
    that exist on entry. Tensors made before entry and not reachable from model / optimizer
    (e.g. the input batch) are not counted; pass them as ``extra``.
    CUDA: ``peak`` is ``torch.cuda.max_memory_allocated`` over the window (absolute, everything
    on the device); the category split comes from the tracker and ``other`` takes the remainder.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        device: torch.device | str,
        extra: Iterable[torch.Tensor] = (),
        on_moment: Any = None,
    ) -> None:
        self.model = model
        # called where units may change (harness.measure.timeline): module boundaries, collectives
        self.on_moment = on_moment
        # one optimizer or several (a wrapper and the optimizer inside it): the torch optimizers'
        # state is tracked from entry; an object that only looks like one has none of its own
        self.optimizers = [o for o in optimizer_list(optimizer) if isinstance(o, torch.optim.Optimizer)]
        self.device = torch.device(device)
        self.extra = list(extra)
        self.tracker: MemTracker | None = None
        self._cuda_peak: int | None = None
        self._gc_was_enabled = False

    def __enter__(self) -> PeakMemory:
        # Garbage from earlier work, collected at a moment that depends on the process's history,
        # would otherwise land inside the window at random: collect it first, then hold the
        # collector off so only reference counting frees tensors while we measure.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        if _is_fsdp2(self.model):
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState

            class _FSDPTracker(_GlobalPeakOnly, FSDPMemTracker):
                # FSDPMemTracker hooks FSDP's own states, not the module tracker's user hooks: ours take those
                def __enter__(self):  # type: ignore[no-untyped-def]
                    entered = super().__enter__()
                    if self._depth == 1:
                        self._mod_tracker.register_user_hooks(self._moment, self._moment, self._moment, self._moment)
                    return entered

                def __exit__(self, *args: Any) -> None:
                    if self._depth == 1:
                        self._mod_tracker.clear_user_hooks()
                    super().__exit__(*args)

                def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                    # FSDPMemTracker's own, without rebuilding the result's structure to visit its tensors and
                    # without walking the mode stack for a fake mode (as _CollectiveAwareTracker's), and a moment
                    # at each collective
                    if DTensor is not None and DTensor in types:
                        return NotImplemented
                    res, real = self._run(func, args, kwargs or {})
                    if real:
                        if func is _GATHER_BASE and self._fsdp_state in (_FSDPState.PRE_FW, _FSDPState.PRE_BW):
                            self._update_and_maybe_create_winfos(args[0], _FSDPRefType.ALL_GATHER, update_existing=True)
                        if func is _SCATTER_BASE and self._fsdp_state == _FSDPState.POST_BW:
                            self._update_and_maybe_create_winfos(
                                args[1], _FSDPRefType.REDUCE_SCATTER, update_existing=True
                            )
                        self._track_made(tensors_in(res), _FSDPRefType)
                    if func.namespace in _COLLECTIVES:
                        self._moment()
                    return res

            # it instruments one optimizer: the one holding state; any other's state counts as other
            main = max(self.optimizers, key=lambda o: len(o.state), default=None)
            self.tracker = _FSDPTracker(self.model, main)
            rest = optimizer_state_tensors([o for o in self.optimizers if o is not main])
            self.tracker.track_inputs(tuple(self.extra + rest))  # its track_external is a no-op
        else:
            self.tracker = _CollectiveAwareTracker()
            self.tracker.track_external(self.model, *self.optimizers, *self.extra)
        self.extra = []  # tracked now; kept here they could not be freed during the step
        self.tracker._on_moment = self.on_moment
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.__enter__()
        return self

    def next_forward(self) -> None:
        """Before the second and later forwards inside the window (micro-batches): the torch tracker
        refuses a module run again unless its per-module statistics are cleared. The peak stays."""
        if self.tracker is not None:
            self.tracker.reset_mod_stats()

    def __exit__(self, *exc: Any) -> None:
        assert self.tracker is not None
        try:
            self.tracker.__exit__(*exc)
        finally:
            self.tracker.forget()  # its records end with the window (harness.bench.measured_step measures several)
            if self._gc_was_enabled:
                gc.enable()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = int(torch.cuda.max_memory_allocated(self.device))

    def result(self) -> dict[str, int]:
        """{"params", "grads", "optimizer_state", "activations", "other", "peak"} in bytes."""
        if self.tracker is None:
            raise RuntimeError("PeakMemory.result() called before the context was used")
        snaps = self.tracker.get_tracker_snapshot("peak")
        out = dict.fromkeys(CATEGORIES, 0)
        for dev, snap in snaps.items():
            if torch.device(dev).type != self.device.type:
                continue
            for ref, nbytes in snap.items():
                if ref == "Total":
                    continue
                name = ref.value if hasattr(ref, "value") else str(ref)
                out[_CATEGORY_OF.get(name, "other")] += int(nbytes)
        tracked = sum(out.values())
        if self._cuda_peak is not None:
            out["other"] += max(0, self._cuda_peak - tracked)
            out["peak"] = max(self._cuda_peak, tracked)
        else:
            out["peak"] = tracked
        return out
