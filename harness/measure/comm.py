"""Count collectives and the bytes they handle, for any implementation, in one rank.

Every ``torch.distributed`` collective in torch >= 2.1 reaches the dispatcher as a ``torch.ops.c10d.*``
op (the Python API and the C++ ``ProcessGroup`` wrappers, which DDP's reducer and FSDP1/FSDP2 use, all
call it), and functional collectives (DTensor redistribution, ``torch.distributed._functional_collectives``)
as ``torch.ops._c10d_functional.*``. `CommCounter` counts them with a kernel of its own on each op of those
namespaces, registered once per process at the dispatcher's ``BackendSelect`` key: a key every call passes
(it is in every thread's included set, inference mode included, and below the Python key, so tensor
subclasses such as DTensor have lowered to plain tensors and dispatch modes have run) before the op's own
kernel, to which it hands the call on. No Python runs for any other operation: a dispatch mode over every
operation of a step costs a large share of a small model's step (reports/performance.md#the-measured-step). A
collective that calls another through the dispatcher (a functional collective's kernel calls the c10d op) is
counted once, as the outer one.

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
``ProcessGroup`` methods), functional collectives, DDP's reducer, FSDP1 and FSDP2 all reach the
dispatcher, from whatever thread issues them (an implementation's prefetch or communication thread
included): a counter counts every collective of the process while it is entered. The one Python path
that does not reach the dispatcher is calling a backend object directly
(``pg._get_backend(device).allreduce(...)``): while a counter is entered the ``Backend`` methods are
wrapped to count those calls too (no double count: the dispatcher path calls them from C++). Still
unseen: kernels that move data without any c10d op (custom extensions, symmetric-memory one-sided ops).
An op of a c10d namespace that the tables below do not know is reported as ``unknown:<ns>.<op>`` with 0
bytes rather than dropped silently.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from torch.distributed.tensor import DTensor as DTENSOR  # None: torch built without distributed
except ImportError:
    DTENSOR = None

__all__ = ["CommCounter"]


@dataclass(frozen=True)
class Size:
    """What one collective handles: elements, bytes and the element type ('float32', or 'mixed'
    for a list of tensors of several types)."""

    elements: int = 0
    bytes: int = 0
    dtype: str = ""

    def __mul__(self, k: int) -> Size:
        return Size(self.elements * int(k), self.bytes * int(k), self.dtype)

    def __add__(self, other: Size) -> Size:
        dtype = self.dtype if other.dtype in ("", self.dtype) else other.dtype if not self.dtype else "mixed"
        return Size(self.elements + other.elements, self.bytes + other.bytes, dtype)


def _size(x: Any) -> Size:
    """Size of a tensor, or the sum over a (nested) list of tensors."""
    if isinstance(x, torch.Tensor):
        return Size(x.numel(), x.numel() * x.element_size(), str(x.dtype).removeprefix("torch."))
    if isinstance(x, (list, tuple)):
        return sum((_size(y) for y in x), Size())
    return Size()


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors of an argument: a tensor, or a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_of(y)]
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
    "_reduce_scatter_base_": 1,
    "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "alltoall_": 1,
    "alltoall_base_": 1,
    "reduce_": 0,
    "reduce_scatter_tensor": 0,
    "reduce_scatter_tensor_out": 0,
    "reduce_scatter_tensor_coalesced": 0,
    "all_reduce": 0,
    "all_reduce_": 0,
    "all_reduce_coalesced": 0,
    "all_reduce_coalesced_": 0,
    "all_to_all_single": 0,
}
COLLECTIVE_NAMESPACES = {
    "c10d": _C10D,
    "_c10d_functional": _FUNCTIONAL,
    "_c10d_functional_autograd": _FUNCTIONAL,
    "c10d_functional": _FUNCTIONAL,
}
# Not communication: waits and the like.
_WAITS = {"wait_tensor", "wait"}
_IGNORED = _WAITS | {"_wrap_tensor_autograd", "check_for_nan"}


def op_kind(func: Any) -> str | None:
    """'wait' for an op that waits on a collective (``wait_tensor``), 'collective' for an op of a c10d
    namespace that communicates (an unknown one included), None for any other op."""
    ns, packet = getattr(func, "namespace", None), getattr(func, "_overloadpacket", None)
    if ns not in COLLECTIVE_NAMESPACES or packet is None:
        return None
    name = packet.__name__
    return "wait" if name in _WAITS else None if name in _IGNORED else "collective"


# Methods of a c10d ``Backend`` (``pg._get_backend(device)``): calling them from Python skips the
# dispatcher, so while a counter is active they are wrapped. Each maps to the c10d op with the
# same argument order; the backend object stands in for the op's process-group argument.
_BACKEND_METHODS = {
    "broadcast": "broadcast_",
    "allreduce": "allreduce_",
    "allreduce_coalesced": "allreduce_coalesced_",
    "reduce": "reduce_",
    "allgather": "allgather_",
    "_allgather_base": "_allgather_base_",
    "allgather_coalesced": "allgather_coalesced_",
    "gather": "gather_",
    "scatter": "scatter_",
    "reduce_scatter": "reduce_scatter_",
    "_reduce_scatter_base": "_reduce_scatter_base_",
    "alltoall": "alltoall_",
    "alltoall_base": "alltoall_base_",
    "send": "send",
    "recv": "recv_",
    "recv_anysource": "recv_any_source_",
    "barrier": "barrier",
    "monitored_barrier": "monitored_barrier_",
}
_SAVED: list[tuple[Any, str, Any]] = []  # (class, method, original) while patched
_LOCK = threading.Lock()


class WhileEntered:
    """A process-wide patch installed while at least one owner (a counter or a dispatch mode of this process) is
    entered: `owners` are those entered and not yet exited, outermost first."""

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


def _backend_class() -> Any:
    try:
        from torch._C._distributed_c10d import Backend
    except ImportError:
        return None
    return Backend


def _patch() -> None:
    cls = _backend_class()
    for meth, op in _BACKEND_METHODS.items() if cls is not None else ():
        orig = cls.__dict__.get(meth)
        if orig is None:
            continue
        _SAVED.append((cls, meth, orig))

        def wrapper(self: Any, *args: Any, _orig: Any = orig, _op: str = op, **kwargs: Any) -> Any:
            collective, size = _C10D[_op]
            padded = (tuple(args[:2]) + (None, None))[:2] + (self,)
            for counter in list(_COUNTERS.owners):
                counter._record(collective, size(padded), int(self.size()))
            return _orig(self, *args, **kwargs)

        setattr(cls, meth, wrapper)


def _unpatch() -> None:
    for cls, meth, orig in reversed(_SAVED):
        setattr(cls, meth, orig)
    _SAVED.clear()


_COUNTERS = WhileEntered(_patch, _unpatch)  # the counters entered: the Backend methods are wrapped while there are


def plain_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t`'s value: contiguous, on the CPU, in `dtype` (its own by default). A plain tensor is copied
    with Python dispatch off: no mode (the localiser's tracer, the peak-memory tracker) sees
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


def classify(func: Any, args: tuple) -> tuple[str, Size] | None:
    """(collective, size) for a collective op, None for any other op."""
    packet = getattr(func, "_overloadpacket", None)
    ns = getattr(func, "namespace", None)
    table = COLLECTIVE_NAMESPACES.get(ns or "")
    if table is None or packet is None:
        return None
    name = packet.__name__
    if name in _IGNORED:
        return None
    if name not in table:
        return ("unknown:" + f"{ns}.{name}", Size())
    collective, size = table[name]
    return collective, size(args)


# The counting kernels: registered at the first counter's entry, once per process, and kept for its life (a
# Library unregisters what it holds when it is collected). The c10d namespaces' ops are registered by torch's
# own libraries when they load, so every one is known then (reading the dispatcher's op names is cheap, once:
# reports/performance.md#imports).
_LIBRARIES: dict[str, Any] = {}
_AFTER_BACKEND_SELECT = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
_INSIDE = threading.local()  # .depth: > 0 while this thread runs a counted collective's kernel


def _counting_kernel(op: Any) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        keyset = keyset & _AFTER_BACKEND_SELECT
        if not _COUNTERS.owners or getattr(_INSIDE, "depth", 0):  # none entered, or called by a counted one
            return op.redispatch(keyset, *args, **kwargs)
        found = classify(op, args)
        if found is not None:
            ranks = _group_ranks(args)
            digest = None
            for counter in list(_COUNTERS.owners):
                counter._record(*found, ranks)
                if counter.fingerprint:
                    digest = digest or _reduction_digest(found[0], op, args)
                    if digest is not None:
                        counter.reduction_inputs.append(digest)
        _INSIDE.depth = getattr(_INSIDE, "depth", 0) + 1
        try:
            return op.redispatch(keyset, *args, **kwargs)
        finally:
            _INSIDE.depth -= 1

    return kernel


def _install() -> None:
    """Register the counting kernel on every op of the c10d namespaces (waits and the like excepted), once."""
    if _LIBRARIES:
        return
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, rest = qualified.partition("::")
        if ns not in COLLECTIVE_NAMESPACES:
            continue
        name, _, overload = rest.partition(".")
        if name in _IGNORED:
            continue
        op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
        if ns not in _LIBRARIES:
            _LIBRARIES[ns] = torch.library.Library(ns, "IMPL")
        _LIBRARIES[ns].impl(rest, _counting_kernel(op), "BackendSelect", with_keyset=True)


def reduction_input(func: Any, args: tuple) -> list[torch.Tensor] | None:
    """The tensors a collective puts into a sum across ranks (this rank's contribution), None for one that
    reduces nothing."""
    index = _REDUCTION_INPUT.get(func._overloadpacket.__name__)
    return tensors_of(args[index]) if index is not None and index < len(args) else None


def _reduction_digest(collective: str, op: Any, args: tuple) -> tuple[str, int, str] | None:
    """(collective, elements, hash of the bytes) of what this rank puts into a reduction, before it runs (the
    input of an in-place all-reduce is overwritten by it); None for a collective that reduces nothing."""
    tensors = reduction_input(op, args)
    if tensors is None:
        return None
    return collective, sum(t.numel() for t in tensors), tensor_digest(*tensors)


class CommCounter:
    """Counts calls, elements and full-tensor bytes per collective and element type issued in this
    process, in any thread, while entered: at the dispatcher, and at the ``Backend`` methods called from
    Python.

    Usage: ``with CommCounter() as cc: step(); cc.summary()``. Re-entering resets the counts.
    """

    def __init__(self, fingerprint: bool = False) -> None:
        # (collective, element type, ranks of its group) -> calls, sizes
        self.calls: dict[tuple[str, str, int], int] = defaultdict(int)
        self.sizes: dict[tuple[str, str, int], Size] = defaultdict(Size)
        self.fingerprint = fingerprint
        # (collective, elements, hash of the bytes) of each reduction's input, in issue order (fingerprint=True;
        # at the dispatcher)
        self.reduction_inputs: list[tuple[str, int, str]] = []

    def __enter__(self) -> CommCounter:
        self.calls.clear()
        self.sizes.clear()
        self.reduction_inputs.clear()
        with _LOCK:
            _install()
        _COUNTERS.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _COUNTERS.exit(self)

    def _record(self, collective: str, size: Size, ranks: int = 0) -> None:
        key = (collective, size.dtype, ranks)
        with _LOCK:
            self.calls[key] += 1
            self.sizes[key] = self.sizes[key] + size

    def summary(self) -> list[dict]:
        """One dict per collective, element type and group size seen: {"collective", "dtype", "ranks", "calls",
        "elements", "bytes"}, sorted ("ranks": of the group it ran over, 0 where unknown)."""
        return [
            {
                "collective": c,
                "dtype": d,
                "ranks": r,
                "calls": self.calls[(c, d, r)],
                "elements": self.sizes[(c, d, r)].elements,
                "bytes": self.sizes[(c, d, r)].bytes,
            }
            for c, d, r in sorted(self.calls)
        ]

    def bytes_of(self, collective: str) -> int:
        return sum(s.bytes for (c, *_), s in self.sizes.items() if c == collective)

    def elements_of(self, collective: str, ranks: int | None = None) -> int:
        """Elements of `collective` (over groups of `ranks` ranks only, if given)."""
        return sum(s.elements for (c, _, r), s in self.sizes.items() if c == collective and ranks in (None, r))

    def calls_of(self, collective: str) -> int:
        return sum(n for (c, *_), n in self.calls.items() if c == collective)
