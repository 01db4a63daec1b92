"""Count collectives and the bytes they handle, for any implementation, in one rank.

`CommCounter` is a ``TorchDispatchMode``. Every ``torch.distributed`` collective in torch >= 2.1
reaches the dispatcher as a ``torch.ops.c10d.*`` op (the Python API and the C++ ``ProcessGroup``
wrappers, which DDP's reducer and FSDP1/FSDP2 use, all call it), and functional collectives
(DTensor redistribution, ``torch.distributed._functional_collectives``) as
``torch.ops._c10d_functional.*``; both are counted. DTensor ops are handed back
(``NotImplemented``) so that the collectives they lower to are seen, as ``CommDebugMode`` does.

Size: the FULL (unsharded) tensor each collective handles, on this rank, in elements and in bytes,
per element type (so a reduction in float64 reads as the same elements at twice the bytes):

    all_gather      output (W x the input shard)      reduce_scatter  input (W x the output shard)
    all_reduce      the tensor                        broadcast       the tensor
    all_to_all      the input                         reduce          the tensor
    gather/scatter  W x this rank's piece             send / recv     the tensor
    barrier         0 (calls only)

So a ZeRO-3 step over P parameter elements (padded to a multiple of W, as all-gather needs equal
shards) shows all_gather 2P (forward + backward re-gather) and reduce_scatter P
(`harness.measure.ideals.ideal_comm_elements`): the "algorithm size". A ring puts (W-1)/W of it on the wire per rank.

Checked on gloo (torch 2.13): every public ``torch.distributed`` collective and p2p call (sync
or async, list or tensor form, object collectives, ``_coalescing_manager``, ``batch_isend_irecv``,
``ProcessGroup`` methods), DDP's reducer, FSDP1 and FSDP2 all reach the dispatcher. The one
Python path that does not is calling a backend object directly
(``pg._get_backend(device).allreduce(...)``): while a counter is active the ``Backend`` methods
are wrapped to count those calls too (no double count: the dispatcher path calls them from C++).
The mode is thread-local (autograd's worker threads inherit it; its CPU backward runs in the
calling thread), so while a counter is active the ``ProcessGroup`` methods are wrapped too: a
collective issued from Python in any other thread (an implementation's prefetch or communication
thread) is counted there, and one issued where the mode is active is counted once, at the
dispatcher. Still unseen: collectives issued from C++ in a thread of its own that never entered
the mode (no c10d backend does so on gloo or NCCL), functional collectives issued from another
thread, and kernels that move data without any c10d op (custom extensions, symmetric-memory
one-sided ops). An unknown op in a c10d namespace is reported as ``unknown:<ns>.<op>`` with 0
bytes rather than dropped silently.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None

__all__ = ["CommCounter"]


@dataclass(frozen=True)
class Size:
    """What one collective handles: elements, bytes and the element type ('float32', or 'mixed'
    for a list of tensors of several types)."""

    elements: int = 0
    bytes: int = 0
    dtype: str = ""

    def __mul__(self, k: int) -> "Size":
        return Size(self.elements * int(k), self.bytes * int(k), self.dtype)

    def __add__(self, other: "Size") -> "Size":
        dtype = self.dtype if other.dtype in ("", self.dtype) else other.dtype if not self.dtype else "mixed"
        return Size(self.elements + other.elements, self.bytes + other.bytes, dtype)


def _size(x: Any) -> Size:
    """Size of a tensor, or the sum over a (nested) list of tensors."""
    if isinstance(x, torch.Tensor):
        return Size(x.numel(), x.numel() * x.element_size(), str(x.dtype).removeprefix("torch."))
    if isinstance(x, (list, tuple)):
        return sum((_size(y) for y in x), Size())
    return Size()


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of an argument: a tensor, or a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _pg_size(pg: Any) -> int:
    """World size of the group argument (a boxed ``ScriptObject`` at the dispatcher)."""
    if isinstance(pg, torch.ScriptObject):
        import torch.distributed as dist
        pg = dist.ProcessGroup.unbox(pg)
    return int(pg.size())


def _group_ranks(args: tuple) -> int:
    """Ranks of the group a collective runs over: its process-group argument's size (a boxed group at the
    dispatcher, a ``ProcessGroup`` or backend object in the wrapped methods) or, for a functional collective,
    its group name's; 0 where the arguments name none."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            return _pg_size(a)
        if isinstance(a, str):  # a functional collective's group name (or its reduce op: not a group)
            try:
                from torch.distributed.distributed_c10d import _resolve_process_group
                return int(_resolve_process_group(a).size())
            except (ImportError, RuntimeError, ValueError, KeyError):
                continue
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, torch.Tensor) and hasattr(a, "rank"):
            return int(size())
    return 0


# c10d op name -> (collective, bytes(args)); args are the op's positional arguments.
_C10D: dict[str, tuple[str, Callable[[tuple], Size]]] = {
    "_allgather_base_": ("all_gather", lambda a: _size(a[0])),
    "allgather_": ("all_gather", lambda a: _size(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a: _size(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _size(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _size(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _size(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _size(a[1])),
    "allreduce_": ("all_reduce", lambda a: _size(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _size(a[0])),
    "broadcast_": ("broadcast", lambda a: _size(a[0])),
    "alltoall_": ("all_to_all", lambda a: _size(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _size(a[1])),
    "reduce_": ("reduce", lambda a: _size(a[0])),
    "gather_": ("gather", lambda a: _size(a[1]) * _pg_size(a[2])),
    "scatter_": ("scatter", lambda a: _size(a[0]) * _pg_size(a[2])),
    "send": ("send", lambda a: _size(a[0])),
    "recv_": ("recv", lambda a: _size(a[0])),
    "recv_any_source_": ("recv", lambda a: _size(a[0])),
    "barrier": ("barrier", lambda a: Size()),
    "monitored_barrier_": ("barrier", lambda a: Size()),
}

# _c10d_functional op name -> (collective, bytes(args)); group_size is an explicit argument.
_FUNCTIONAL: dict[str, tuple[str, Callable[[tuple], Size]]] = {
    "all_gather_into_tensor": ("all_gather", lambda a: _size(a[0]) * a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _size(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _size(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _size(a[0])),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _size(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _size(a[0])),
    "all_reduce": ("all_reduce", lambda a: _size(a[0])),
    "all_reduce_": ("all_reduce", lambda a: _size(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _size(a[0])),
    "all_reduce_coalesced_": ("all_reduce", lambda a: _size(a[0])),
    "broadcast": ("broadcast", lambda a: _size(a[0])),
    "broadcast_": ("broadcast", lambda a: _size(a[0])),
    "all_to_all_single": ("all_to_all", lambda a: _size(a[0])),
    "isend": ("send", lambda a: _size(a[0])),
    "irecv": ("recv", lambda a: _size(a[0])),
    "batch_p2p_ops": ("p2p", lambda a: _size(a[3])),
}
# op name -> the argument that holds a reduction's input (what each rank contributes to the sum), for the
# collectives that sum across ranks: fingerprinted when a counter is asked to (CommCounter(fingerprint=True))
_REDUCTION_INPUT = {
    "_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1, "allreduce_": 0,
    "allreduce_coalesced_": 0, "alltoall_": 1, "alltoall_base_": 1, "reduce_": 0,
    "reduce_scatter_tensor": 0, "reduce_scatter_tensor_out": 0, "reduce_scatter_tensor_coalesced": 0,
    "all_reduce": 0, "all_reduce_": 0, "all_reduce_coalesced": 0, "all_reduce_coalesced_": 0,
    "all_to_all_single": 0,
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCTIONAL,
               "_c10d_functional_autograd": _FUNCTIONAL, "c10d_functional": _FUNCTIONAL}
# Not communication: waits and the like.
_WAITS = {"wait_tensor", "wait"}
_IGNORED = _WAITS | {"_wrap_tensor_autograd", "check_for_nan"}


def op_kind(func: Any) -> str | None:
    """'wait' for an op that waits on a collective (``wait_tensor``), 'collective' for an op of a c10d
    namespace that communicates (an unknown one included), None for any other op."""
    ns, packet = getattr(func, "namespace", None), getattr(func, "_overloadpacket", None)
    if ns not in _NAMESPACES or packet is None:
        return None
    name = packet.__name__
    return "wait" if name in _WAITS else None if name in _IGNORED else "collective"


# Methods of a c10d ``Backend`` (``pg._get_backend(device)``): calling them from Python skips the
# dispatcher, so while a counter is active they are wrapped. Each maps to the c10d op with the
# same argument order; the backend object stands in for the op's process-group argument.
_BACKEND_METHODS = {
    "broadcast": "broadcast_", "allreduce": "allreduce_", "allreduce_coalesced": "allreduce_coalesced_",
    "reduce": "reduce_", "allgather": "allgather_", "_allgather_base": "_allgather_base_",
    "allgather_coalesced": "allgather_coalesced_", "gather": "gather_", "scatter": "scatter_",
    "reduce_scatter": "reduce_scatter_", "_reduce_scatter_base": "_reduce_scatter_base_",
    "alltoall": "alltoall_", "alltoall_base": "alltoall_base_", "send": "send", "recv": "recv_",
    "recv_anysource": "recv_any_source_", "barrier": "barrier", "monitored_barrier": "monitored_barrier_",
}
# Methods of a ``ProcessGroup``: every ``torch.distributed`` call made from Python goes through one
# of them, in whatever thread. The dispatcher path behind them is seen by the counter only in the
# threads it was entered in (a dispatch mode is thread-local; autograd's worker threads inherit
# it), so these wrappers count the calls made from any OTHER thread: a prefetch or communication
# thread of the implementation's own.
_PG_METHODS = {
    **_BACKEND_METHODS,
    "all_gather_single": "_allgather_base_", "all_gather_single_coalesced": "allgather_into_tensor_coalesced_",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced_",
    "reduce_scatter_single": "_reduce_scatter_base_",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced_", "all_to_all_single": "alltoall_base_",
}
_SAVED: list[tuple[Any, str, Any]] = []  # (class, method, original) while patched
_LOCK = threading.Lock()


class WhileEntered:
    """A process-wide patch installed while at least one owner (a dispatch mode of this process) is entered:
    `owners` are those entered and not yet exited, outermost first."""

    def __init__(self, patch: Callable[[], None], unpatch: Callable[[], None]) -> None:
        self.patch, self.unpatch = patch, unpatch
        self.owners: list = []
        self.lock = threading.Lock()

    def enter(self, owner: Any) -> None:
        with self.lock:
            if not self.owners:
                self.patch()
            self.owners.append(owner)

    def exit(self, owner: Any) -> None:
        with self.lock:
            self.owners.remove(owner)
            if not self.owners:
                self.unpatch()


def _c10d_classes() -> list[tuple[Any, dict[str, str], bool]]:
    """(class, method -> c10d op, count only in threads where no counter is active)."""
    try:
        from torch._C._distributed_c10d import Backend, ProcessGroup
    except ImportError:
        return []
    return [(Backend, _BACKEND_METHODS, False), (ProcessGroup, _PG_METHODS, True)]


def _counted_here(counter: "CommCounter") -> bool:
    """Whether the dispatcher will count an op issued now, in this thread, for `counter`."""
    return counter in _get_current_dispatch_mode_stack()


def _patch() -> None:
    for cls, methods, other_threads_only in _c10d_classes():
        for meth, op in methods.items():
            orig = cls.__dict__.get(meth)
            if orig is None:
                continue
            _SAVED.append((cls, meth, orig))

            def wrapper(self: Any, *args: Any, _orig: Any = orig, _op: str = op, _other: bool = other_threads_only,
                        **kwargs: Any) -> Any:
                collective, size = _C10D[_op]
                padded = (tuple(args[:2]) + (None, None))[:2] + (self,)
                for counter in list(_COUNTERS.owners):
                    if not (_other and _counted_here(counter)):
                        counter._record(collective, size(padded), int(self.size()))
                return _orig(self, *args, **kwargs)

            setattr(cls, meth, wrapper)


def _unpatch() -> None:
    for cls, meth, orig in reversed(_SAVED):
        setattr(cls, meth, orig)
    _SAVED.clear()


_COUNTERS = WhileEntered(_patch, _unpatch)  # the counters entered: the c10d methods are wrapped while there are


def plain_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t`'s value: contiguous, on the CPU, in `dtype` (its own by default). A plain tensor is copied
    with Python dispatch off: no mode (the localiser's tracer, this counter, the peak-memory tracker) sees
    the harness's own copy, nor pays its Python for it."""
    if torch._C._dispatch_keys(t).has(torch._C.DispatchKey.Python):  # a subclass that dispatches in Python
        return t.detach().to("cpu", dtype or t.dtype, copy=True, memory_format=torch.contiguous_format)
    with torch._C._DisableTorchDispatch():
        return t.detach().to("cpu", dtype or t.dtype, copy=True, memory_format=torch.contiguous_format)


def tensor_digest(*tensors: torch.Tensor) -> str:
    """A CRC-32 of the tensors' bytes, read in place where the tensor is a contiguous CPU one (a copy
    otherwise): neither a numpy view, which would make the tensor's storage non-resizable (implementations
    resize theirs), nor a copy of every tensor an op makes."""
    crc = 0
    for t in tensors:
        if not (t.is_cpu and t.is_contiguous()):  # a copy (else read in place: no op dispatched)
            t = plain_copy(t)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            crc = zlib.crc32((ctypes.c_char * nbytes).from_address(t.data_ptr()), crc)
    return f"{crc:08x}"


def _classify(func: Any, args: tuple) -> tuple[str, Size] | None:
    """(collective, size) for a collective op, None for any other op."""
    packet = getattr(func, "_overloadpacket", None)
    ns = getattr(func, "namespace", None)
    table = _NAMESPACES.get(ns or "")
    if table is None or packet is None:
        return None
    name = packet.__name__
    if name in _IGNORED:
        return None
    if name not in table:
        return ("unknown:" + f"{ns}.{name}", Size())
    collective, size = table[name]
    return collective, size(args)


class CommCounter(TorchDispatchMode):
    """Counts calls, elements and full-tensor bytes per collective and element type issued in this
    process while active: in this thread (and autograd's) at the dispatcher, in any other thread at
    the ``ProcessGroup`` methods.

    Usage: ``with CommCounter() as cc: step(); cc.summary()``. Re-entering resets the counts.
    """

    def __init__(self, fingerprint: bool = False) -> None:
        super().__init__()
        # (collective, element type, ranks of its group) -> calls, sizes
        self.calls: dict[tuple[str, str, int], int] = defaultdict(int)
        self.sizes: dict[tuple[str, str, int], Size] = defaultdict(Size)
        self.fingerprint = fingerprint
        # (collective, elements, hash of the bytes) of each reduction's input, in issue order (fingerprint=True;
        # this thread's and autograd's, at the dispatcher)
        self.reduction_inputs: list[tuple[str, int, str]] = []

    def __enter__(self) -> "CommCounter":
        self.calls.clear()
        self.sizes.clear()
        self.reduction_inputs.clear()
        _COUNTERS.enter(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _COUNTERS.exit(self)

    def _record(self, collective: str, size: Size, ranks: int = 0) -> None:
        key = (collective, size.dtype, ranks)
        with _LOCK:
            self.calls[key] += 1
            self.sizes[key] = self.sizes[key] + size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Let tensor subclasses (DTensor) lower to plain ops first; those come back here.
        if _DTensor is not None and _DTensor in types:
            return NotImplemented
        if getattr(func, "namespace", None) not in _NAMESPACES:  # not communication: most operations
            return func(*args, **kwargs)
        found = _classify(func, tuple(args))
        if found is not None:
            self._record(*found, _group_ranks(tuple(args)))
            if self.fingerprint:
                self._fingerprint(found[0], func, args)
        return func(*args, **kwargs)

    def _fingerprint(self, collective: str, func: Any, args: tuple) -> None:
        """Hash what this rank puts into a reduction, before it runs (the input of an in-place all-reduce
        is overwritten by it)."""
        index = _REDUCTION_INPUT.get(func._overloadpacket.__name__)
        if index is None or index >= len(args):
            return
        tensors = _tensors(args[index])
        self.reduction_inputs.append((collective, sum(t.numel() for t in tensors), tensor_digest(*tensors)))

    def summary(self) -> list[dict]:
        """One dict per collective, element type and group size seen: {"collective", "dtype", "ranks", "calls",
        "elements", "bytes"}, sorted ("ranks": of the group it ran over, 0 where unknown)."""
        return [{"collective": c, "dtype": d, "ranks": r, "calls": self.calls[(c, d, r)],
                 "elements": self.sizes[(c, d, r)].elements, "bytes": self.sizes[(c, d, r)].bytes}
                for c, d, r in sorted(self.calls)]

    def bytes_of(self, collective: str) -> int:
        return sum(s.bytes for (c, *_), s in self.sizes.items() if c == collective)

    def elements_of(self, collective: str, ranks: int | None = None) -> int:
        """Elements of `collective` (over groups of `ranks` ranks only, if given)."""
        return sum(s.elements for (c, _, r), s in self.sizes.items() if c == collective and ranks in (None, r))

    def calls_of(self, collective: str) -> int:
        return sum(n for (c, *_), n in self.calls.items() if c == collective)
