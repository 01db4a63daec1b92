"""Which units hold their full parameters at each moment of a training step.

ZeRO-3 keeps a unit's parameters gathered only while it runs (and, with prefetching, while the
unit before it runs). A peak-memory figure cannot show a unit left gathered after its forward on a
model whose units are few or small: the bound that allows two units unsharded may exceed the whole
model. Counting units can, on every model.

A unit is *gathered* at a moment when the storages behind its own parameters, looked up where the
plain model keeps them (the module attribute, whatever an implementation has put there: a
Parameter, a view into a flat buffer, a DTensor whose local shard is counted), hold at least the
unit's parameter elements. A unit's own parameters are those of its submodules that no nested unit
claims; the root's are what no unit claims. Tied parameters belong to the first unit that has them.

Moments: the measured step's module boundaries (each module's forward and backward, entered and left) and its
collectives, where the peak tracker calls `sample`, and one moment between phases (`mark`). An implementation
changes which units it holds gathered in its own hooks around a unit's forward and backward and around the
collectives that gather and reduce; a unit gathered across a boundary is seen there, and one prefetched is seen
at the next boundary it outlives (sampling every tensor operation instead gave the same records at several times
the samples: reports/performance.md#the-measured-step). The phases, and how many units other than the root
ZeRO-3 lets a rank hold gathered at once in each (`ALLOWED`; the root's own parameters may stay
gathered from forward to the end of backward, as FSDP2 keeps them):

    forward          2   the unit running and one prefetched
    after_forward    1   the first unit of backward, prefetched; covers the loss computation
    backward         2   the unit running and one prefetched
    after_backward   0   everything resharded, root included
    optimizer        0   root included
    eval             2   feature eval: a torch.no_grad() forward after the optimizer step, as forward
    after_eval       0   once that forward and its loss are done: no backward follows a no_grad
                         forward, so nothing else would reshard what it gathered (pytorch #149029)

The root's own parameters may stay gathered during the eval forward, as during a training one, but
not after it, where no backward will come to reshard them. FSDP2 keeps them (it keeps the root
unsharded after every forward unless reshard_after_forward=True is passed for it: pytorch #149029,
#155319; a documented deviation, harness/core/policy.py). Only the phases of the scenario's feature
are expected (`expected_phases`): eval and after_eval under eval.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

DTensor = None  # torch.distributed.tensor's, once a timeline is built (the process that judges needs none)


def _load_dtensor() -> None:
    global DTensor
    if DTensor is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch built without distributed
            pass


__all__ = ["UnitTimeline", "PHASES", "ALLOWED", "ROOT", "expected_phases"]

PHASES = ("forward", "after_forward", "backward", "after_backward", "optimizer", "eval", "after_eval")
ALLOWED = {
    "forward": 2,
    "after_forward": 1,
    "backward": 2,
    "after_backward": 0,
    "optimizer": 0,
    "eval": 2,
    "after_eval": 0,
}
# phases in which the root may stay gathered
ROOT_FREE = ("forward", "after_forward", "backward", "eval")
EVAL_PHASES = ("eval", "after_eval")  # only under feature eval


def expected_phases(feature: str) -> tuple[str, ...]:
    """The phases a measured step of `feature` goes through (every one must be seen)."""
    from harness.core.features import has

    return PHASES if has(feature, "eval") else tuple(p for p in PHASES if p not in EVAL_PHASES)


ROOT = "(root)"


@dataclass
class _Unit:
    name: str
    slots: list[tuple[nn.Module, str]]  # where the plain model keeps its own parameters
    elements: int

    def __post_init__(self) -> None:
        # the module's instance dict and parameter dict per slot: read directly at every moment, as
        # attribute lookup would (instance attribute first, then the registered parameter), minus the cost
        self.lookups = [(m.__dict__, m.__dict__["_parameters"], a) for m, a in self.slots]
        self.numels = [m._parameters[a].numel() for m, a in self.slots]

    def any_whole(self) -> bool:
        """Whether one of the unit's parameters is full (its full shape, its storage holding all of it) now:
        the timeline sees an implementation's gathers even where it never holds a whole unit at once."""
        for (attrs, params, name), full in zip(self.lookups, self.numels):
            t = attrs.get(name)
            if t is None:
                t = params.get(name)
            if _held_elements(t, set()) >= full and isinstance(t, torch.Tensor) and t.numel() == full:
                return True
        return False

    def held(self) -> int:
        """Elements the storages behind the unit's parameters hold now, each storage once."""
        seen: set[int] = set()
        total = 0
        for attrs, params, name in self.lookups:
            t = attrs.get(name)
            if t is None:
                t = params.get(name)
            total += _held_elements(t, seen)
        return total


@dataclass
class _Phase:
    moments: int = 0
    units: int = -1  # the most child units gathered at one moment
    which: str = ""  # their names at the first moment with that many
    root: bool = False  # the root's own parameters gathered at some moment
    params: bool = False  # some unit's parameter (any unit, the root included) full at some moment


def _held_elements(t: object, seen: set[int]) -> int:
    """Elements the storage behind `t` holds (each storage once; a DTensor's local shard)."""
    if not isinstance(t, torch.Tensor):
        return 0
    if DTensor is not None and isinstance(t, DTensor):
        t = t._local_tensor  # the attribute, not to_local(): no operation inside the tracker's dispatch
    if t.is_meta:
        return 0
    st = t.untyped_storage()
    if st._cdata in seen:
        return 0
    seen.add(st._cdata)
    return st.nbytes() // max(1, t.element_size())


class UnitTimeline:
    """Built on the PLAIN model (before an implementation wraps it), so each unit's parameters are
    found where the model keeps them; then `sample`d during a step, phase by phase."""

    def __init__(self, model: nn.Module, units: list[nn.Module]) -> None:
        _load_dtensor()
        names = {id(m): n for n, m in model.named_modules()}
        claimed: set[int] = set()
        self.units: list[_Unit] = []
        for unit in [*units, model]:  # bottom-up: a nested unit claims its parameters first
            slots, elements = [], 0
            for module in unit.modules():
                for attr, p in module._parameters.items():
                    if p is not None and id(p) not in claimed:
                        claimed.add(id(p))
                        slots.append((module, attr))
                        elements += p.numel()
            if elements:
                name = ROOT if unit is model else names.get(id(unit), type(unit).__name__)
                self.units.append(_Unit(name, slots, elements))
        self.phase: str | None = None
        self._phases: dict[str, _Phase] = {}

    def gathered(self) -> list[str]:
        """Names of the units gathered now."""
        return [u.name for u in self.units if u.held() >= u.elements]

    def sample(self) -> None:
        """One moment in the current phase (nothing outside a phase)."""
        if self.phase is None:
            return
        rec = self._phases.setdefault(self.phase, _Phase())
        names = self.gathered()
        children = [n for n in names if n != ROOT]
        rec.moments += 1
        rec.root = rec.root or ROOT in names
        # only while nothing else shows it: the check needs one moment, not every one
        rec.params = rec.params or bool(names) or any(u.any_whole() for u in self.units)
        if len(children) > rec.units:
            rec.units, rec.which = len(children), ", ".join(children)

    def start(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        self.phase = phase

    def mark(self, phase: str, value=None):
        """Enter `phase` and sample the moment at its start; returns `value` (to wrap an expression)."""
        self.start(phase)
        self.sample()
        return value

    def records(self) -> list[dict]:
        """One plain record per phase seen: phase, moments, units, which, root, params."""
        return [
            {"phase": p, "moments": r.moments, "units": r.units, "which": r.which, "root": r.root, "params": r.params}
            for p in PHASES
            if (r := self._phases.get(p)) is not None
        ]
