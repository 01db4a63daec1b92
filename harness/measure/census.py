"""What a rank holds, found from the rank process rather than from the objects an adapter hands over.

`Census` notes every tensor storage alive in the process before the scenario builds its model;
`Census.held(...)` later finds every storage alive that was not, whoever holds it, and files
each under one category:

    params           storages of the model's parameters and of any the optimizer holds
    grads            their ``.grad``
    optimizer_state  tensors in the ``state`` of every optimizer: the one the adapter returned and
                     every ``torch.optim.Optimizer`` the scenario made (an optimizer wrapper's inner
                     optimizer holds the state the wrapper does not)
    buffers          the model's buffers (``module.buffers()``)
    other            anything else: a buffer an implementation keeps per unit between steps, an
                     optimizer wrapper's own state, a cache in a closure or a module global
    unattributed     CUDA only: what the allocator holds for the scenario beyond the storages
                     above (block rounding, library workspaces, storages only C++ holds)
    host_params, host_grads, host_optimizer_state
                     a device census only (CUDA): the storages of the first three categories that
                     live in host memory (state offloaded to the CPU, or any copy an implementation
                     keeps there), so that what leaves the device is counted, not lost. Other host
                     storages are not listed: the host is shared with the harness's own work

Each storage counts once, at its size (a DTensor by its local shard; a storage freed with
``resize_(0)`` counts 0). The harness's own tensors (the batch) are named and left out.

How "alive" is found: on CPU, every tensor the Python garbage collector tracks (after a
collection), which is every tensor reachable from Python; storages that only C++ holds (a
communication library's internal buffers, DDP's gradient buckets, autograd's saved tensors between
forward and backward) are not seen there. On CUDA the allocator sees everything: `held` reports
``torch.cuda.memory_allocated`` beyond what was allocated at the start and beyond the categories
as "unattributed", so the categories sum to what the device really holds for the scenario.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from harness.measure.memory import local_tensor, optimizer_list, state_tensors

__all__ = ["Census", "HELD_CATEGORIES", "HOST_CATEGORIES", "live_tensors"]

HELD_CATEGORIES = ("params", "grads", "optimizer_state", "buffers", "other", "unattributed")
STATE_CATEGORIES = ("params", "grads", "optimizer_state")
HOST_CATEGORIES = tuple(f"host_{c}" for c in STATE_CATEGORIES)  # a device census's (CUDA) host share
# the pauses before each further look of `Census.held`, while more than it tolerates reads as "other" (the first is
# usually enough; the rest, 1.5 s in all, wait for a thread a loaded machine runs late)
SETTLE_S = (0.05, 0.1, 0.2, 0.4, 0.8)
_KEPT: dict = {}  # "refs": the tensors keep_frozen censuses froze, storage id -> tensor


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """(storage id, bytes) of the storage a tensor lives in; None for meta or storage-less tensors."""
    try:
        local = local_tensor(t)
        if local.device.type == "meta":
            return None
        st = local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers...
        return None
    return st._cdata, st.nbytes()


def live_tensors() -> dict[int, tuple[int, torch.Tensor]]:
    """storage id -> (bytes, one tensor that uses it), for every tensor the collector tracks now."""
    gc.collect()
    out: dict[int, tuple[int, torch.Tensor]] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: it reads __class__, which some objects warn on
            k = _key(obj)
            if k is not None and k[0] not in out:
                out[k[0]] = (k[1], obj)
    return out


def _keys(tensors: Iterable[Any]) -> set[int]:
    return {k[0] for t in tensors if isinstance(t, torch.Tensor) and (k := _key(t)) is not None}


class Census:
    """Storages alive at construction are the process's own; `held` reports the rest by category.

    Every object alive at construction is frozen (``gc.freeze``) until `close`: each look then
    collects and walks only the objects made since, a few milliseconds instead of a walk over the
    whole process (torch alone tracks some 300,000 objects). The frozen objects are the process's
    own by definition and are never listed; a new tensor over one of their storages (a view) is
    left out too. Use it as a context manager, or call `close`, so that the process's objects are
    collectable again afterwards.

    ``keep_frozen=True`` (a process that runs one census after another, as a world's rank runs
    scenario after scenario): `close` leaves the frozen objects frozen, and the next such census
    walks only the objects made since the last one froze (the walk over the whole process,
    reports/performance.md#the-measured-step, is paid once per process, not per scenario). What stays
    frozen is what was alive when a census began, never a scenario's own objects (made after the freeze, collectable as
    usual); the tensors among it are held, so that no storage of theirs is freed and its id reused
    by a scenario's. A census that exits on an exception unfreezes everything, so that a failed
    scenario's objects, which the traceback keeps alive, are collectable once it is dropped."""

    def __init__(self, device: torch.device | str = "cpu", *, keep_frozen: bool = False) -> None:
        self.device = torch.device(device)
        self.keep_frozen = keep_frozen
        if self.device.type == "cuda":
            gc.collect()  # no earlier garbage on the device through the scenario (the allocator counts it)
        self._cuda_before = self._cuda_allocated()
        # the tensors a keep_frozen census froze before (held: alive, so the process's own still); had
        # anything unfrozen them since, the walk below would find them again, and nothing is lost
        kept = _KEPT.get("refs") if keep_frozen else None
        if kept is not None:
            gc.collect()  # only what is not frozen: last scenario's garbage is not the process's
        # a tensor made later over a storage alive now (a view) is not the scenario's either; the
        # tensors are held so that no id of theirs is reused by a new storage while the census lasts
        refs = dict(kept or {})
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor) and (k := _key(obj)) is not None:
                refs.setdefault(k[0], obj)
        self._before_refs = refs
        self.before = set(refs)
        gc.freeze()  # from here on the collector (and every look) sees only what the scenario makes
        self._frozen = True
        _KEPT.clear()
        if keep_frozen:
            _KEPT["refs"] = refs

    def close(self, failed: bool = False) -> None:
        if self._frozen:
            self._frozen = False
            self._before_refs = {}
            if failed or not self.keep_frozen:
                _KEPT.clear()
                gc.unfreeze()

    def __enter__(self) -> Census:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self.close(failed=exc_type is not None)

    def _cuda_allocated(self) -> int | None:
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def new_tensors(
        self, exclude: Iterable[torch.Tensor] = (), device_type: str | None = None
    ) -> dict[int, tuple[int, torch.Tensor]]:
        """The storages on this census's device (or on `device_type`) alive now that were not at
        construction, less those of `exclude`."""
        skip, device_type = self.before | _keys(exclude), device_type or self.device.type
        return {
            k: v for k, v in live_tensors().items() if k not in skip and local_tensor(v[1]).device.type == device_type
        }

    def optimizers(self, optimizer: Any) -> list[Any]:
        """`optimizer` (one or several) and every other ``torch.optim.Optimizer`` alive that the
        scenario made: whatever an adapter's optimizer wraps, its state is found."""
        given = optimizer_list(optimizer)
        seen = {id(o) for o in given}
        return given + [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer) and id(o) not in seen]

    def classify(
        self, model: nn.Module, optimizer: Any, exclude: Iterable[torch.Tensor] = (), device_type: str | None = None
    ) -> list[tuple[str, int, torch.Tensor]]:
        """(category, bytes, a tensor using it) per storage on this census's device (or `device_type`)
        alive now that was not at construction."""
        owner: dict[int, str] = {}
        groups = {**state_tensors(model, optimizer), "buffers": list(model.buffers())}
        for cat, tensors in groups.items():
            for k in _keys(tensors):
                owner.setdefault(k, cat)
        return [(owner.get(k, "other"), nbytes, t) for k, (nbytes, t) in self.new_tensors(exclude, device_type).items()]

    def held(
        self,
        model: nn.Module,
        optimizer: Any,
        exclude: Iterable[torch.Tensor] = (),
        settle: bool = True,
        tolerated: int = 0,
    ) -> dict[str, int]:
        """Bytes held now, by category (HELD_CATEGORIES), each storage once.

        A communication thread may let go of a collective's buffers a moment after the collective
        returned (gloo's worker thread does), and such a buffer would read as held: when the first
        look finds more than `tolerated` bytes (what a check allows a rank to hold there) under "other",
        further looks follow after each of `SETTLE_S` (1.5 s in all; a thread a loaded machine runs late) while
        it still does, and each category keeps its smallest figure. What is really held is there every time. A
        correct run's few bytes of bookkeeping cost no pause: within `tolerated` no look changes a verdict, and a
        buffer let go late can then add at most `tolerated` bytes to the figure. `settle=False` (no collective
        ran since the state was made, so no thread holds a buffer of one) skips it."""
        out = self._held_once(model, optimizer, exclude)
        for pause in SETTLE_S if settle else ():
            if out["other"] <= tolerated:
                break
            time.sleep(pause)
            again = self._held_once(model, optimizer, exclude)
            out = {cat: min(out[cat], again[cat]) for cat in out}
        return out

    def _held_once(self, model, optimizer, exclude) -> dict[str, int]:
        out = dict.fromkeys(HELD_CATEGORIES, 0)
        for cat, nbytes, _ in self.classify(model, optimizer, exclude):
            out[cat] += nbytes
        now = self._cuda_allocated()
        if now is not None and self._cuda_before is not None:
            out["unattributed"] = max(0, now - self._cuda_before - sum(out.values()))
        if self.device.type != "cpu":  # the state that lives in host memory (offloaded): counted, not lost
            out.update(dict.fromkeys(HOST_CATEGORIES, 0))
            for cat, nbytes, _ in self.classify(model, optimizer, exclude, device_type="cpu"):
                if cat in STATE_CATEGORIES:
                    out[f"host_{cat}"] += nbytes
        return out
