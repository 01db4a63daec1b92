"""A resumed run's optimizer state right after loading, held element for element against the state its
saver's ranks held when they saved (check ``ckpt_restored``).

Both files are every rank's parts as the rank held them (harness.measure.optim_state: each part with
the global offset of its first element). The saver's parts are put back into whole values; each part
the loading ranks hold is compared with the same elements of those, exactly (loading copies, it
computes nothing; NaN equals NaN, the dtype may change), and together the loading ranks must hold
every element of every value that was saved, and nothing that was not.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

COLUMNS = ("state_restore_diff", "state_restore_param", "state_restore_rank", "state_restore_where", "state_restored")


def compare_files(saved: Path, restored: Path) -> dict:
    """The scenarios-table columns of one resumed run (all NaN / empty when a file is missing):
    state_restore_diff the largest |restored - saved| over every element (0.0: all equal; inf: a value
    or rows missing, extra or of another shape; NaN: could not be compared), state_restore_param,
    state_restore_rank and state_restore_where the worst element (parameter, state key, element,
    the loading rank and both values) or what is missing, state_restored what was compared."""
    if not (saved.exists() and restored.exists()):
        missing = [p.name for p in (saved, restored) if not p.exists()]
        return _result(math.nan, "", None, f"no {' or '.join(missing)} written", "")
    try:
        both = [torch.load(p, weights_only=True) for p in (saved, restored)]
    except Exception as exc:  # noqa: BLE001 (an unreadable file is a comparison that could not be made)
        why = f"cannot read {saved.name} / {restored.name}: {type(exc).__name__}: {exc}"
        return _result(math.nan, "", None, why, "")
    return compare(*both)


def compare(saved: list[dict], restored: list[dict]) -> dict:
    """As compare_files, on the two lists of per-rank held states (saved: the saver's ranks)."""
    for who, ranks in (("the saver", saved), ("the loading run", restored)):
        for rank, rec in enumerate(ranks):
            if rec["problems"]:
                return _result(math.nan, "", rank, f"{who}'s rank {rank}: {rec['problems'][0]}", "")
    whole, problem = _assemble(saved)
    if problem:
        return _result(math.nan, *problem, "")
    worst = _Worst()
    held = {(n, k) for rec in restored for n, keys in rec["state"].items() for k in keys}
    for name, key in [nk for nk in whole if nk not in held]:
        worst.structural(name, None, f"{name} {key}: saved, held by no rank after loading")
    for name, key in sorted(held - set(whole)):
        worst.structural(name, None, f"{name} {key}: held after loading, not saved")
    covered = {}
    for rank, rec in enumerate(restored):
        for name, keys in rec["state"].items():
            for key, part in keys.items():
                if (name, key) in whole:
                    _compare_part(worst, covered, whole[name, key], name, key, rank, part)
    for (name, key), mask in covered.items():
        if mask is not None and not bool(mask.all()):
            first = tuple(int(i) for i in (~mask).nonzero()[0])
            worst.structural(
                name,
                None,
                f"{name} {key}{_index(first)}: held by no rank after loading "
                f"({int((~mask).sum())} of {mask.numel()} elements)",
            )
    keys = sorted({k for _, k in whole})
    what = (
        f"{', '.join(keys)} of {len({n for n, _ in whole})} parameters, {worst.elements} elements over "
        f"{len(restored)} rank(s)"
        if whole
        else "none saved"
    )
    where = worst.where + (f" ({worst.differing} of {worst.elements} elements differ)" if worst.differing else "")
    return _result(worst.diff, worst.param, worst.rank, where, what)


def _result(diff, param, rank, where, what) -> dict:
    return dict(zip(COLUMNS, (diff, param, rank, where, what)))


def _assemble(saved: list[dict]) -> tuple[dict, tuple | None]:
    """(param, key) -> a whole value (float64, NaN-filled then written) or a non-tensor value, from the
    saver's parts (the lowest rank's where replicas overlap); or a problem (param, rank, why)."""
    whole, filled = {}, {}
    for rank, rec in enumerate(saved):
        for name, keys in rec["state"].items():
            for key, part in keys.items():
                if "value" in part:
                    whole.setdefault((name, key), part["value"])
                    continue
                have = whole.setdefault((name, key), torch.full(part["shape"], math.nan, dtype=torch.float64))
                if not isinstance(have, torch.Tensor) or tuple(have.shape) != tuple(part["shape"]):
                    return whole, (name, rank, f"the saver's ranks hold {name} {key} in different shapes")
                mask = filled.setdefault((name, key), torch.zeros(have.shape, dtype=torch.bool))
                where = _slices(part)
                fresh = ~mask[where]
                have[where] = torch.where(fresh, part["local"].double(), have[where])
                mask[where] = True
    for (name, key), mask in filled.items():
        if not bool(mask.all()):
            return whole, (name, None, f"the saver's ranks do not hold every element of {name} {key}")
    return whole, None


def _slices(part: dict) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(part["offset"], part["local"].shape))


def _compare_part(worst: _Worst, covered: dict, saved, name: str, key: str, rank: int, part: dict) -> None:
    if "value" in part or not isinstance(saved, torch.Tensor):
        a, b = part.get("value", part.get("local")), saved
        if any(isinstance(x, torch.Tensor) and x.numel() != 1 for x in (a, b)):
            worst.structural(
                name, rank, f"{name} {key}: rank {rank} holds {_kind(a)} after loading, {_kind(b)} was saved"
            )
            return
        a, b = (float(x) if isinstance(x, (torch.Tensor, int, float)) else x for x in (a, b))
        covered.setdefault((name, key), None)
        worst.elements += 1
        if not (a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))):
            d = abs(a - b) if isinstance(a, float) and isinstance(b, float) else math.inf
            worst.element(d, name, key, rank, (), a, b)
        return
    if tuple(part["shape"]) != tuple(saved.shape):
        worst.structural(
            name,
            rank,
            f"{name} {key}: rank {rank} holds a part of a whole of shape "
            f"{tuple(part['shape'])}, the saved one is {tuple(saved.shape)}",
        )
        return
    mask = covered.setdefault((name, key), torch.zeros(saved.shape, dtype=torch.bool))
    where = _slices(part)
    mask[where] = True
    mine, theirs = part["local"].double(), saved[where]
    worst.elements += mine.numel()
    differ = ~((mine == theirs) | (mine.isnan() & theirs.isnan()))
    if not bool(differ.any()):
        return
    d = torch.where(differ, (mine - theirs).abs().nan_to_num(math.inf), torch.zeros_like(mine))
    at = tuple(int(i) for i in torch.unravel_index(torch.argmax(d), d.shape)) if d.dim() else ()
    index = tuple(o + i for o, i in zip(part["offset"], at))
    worst.element(float(d[at]), name, key, rank, index, float(mine[at]), float(theirs[at]), int(differ.sum()))


def _index(index: tuple) -> str:
    return f"[{', '.join(str(i) for i in index)}]" if index else ""


class _Worst:
    """The largest difference seen, where it is, and how many elements were compared."""

    def __init__(self):
        self.diff, self.param, self.rank, self.where, self.elements, self.differing = 0.0, "", None, "", 0, 0

    def structural(self, param: str, rank, where: str) -> None:
        if self.diff < math.inf:
            self.diff, self.param, self.rank, self.where = math.inf, param, rank, where

    def element(self, d: float, param: str, key: str, rank: int, index: tuple, restored, saved, count: int = 1):
        self.differing += count
        if d > self.diff or not self.where:
            self.diff, self.param, self.rank = d, param, rank
            self.where = (
                f"{param} {key}{_index(index)} on rank {rank}: {_value(restored)} after loading, {_value(saved)} saved"
            )


def _kind(x) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"the value {x!r}"


def _value(x) -> str:
    return f"{x:.9g}" if isinstance(x, float) else repr(x)
