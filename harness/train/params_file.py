"""Named tensors in one file, packed: how rank 0 writes the full parameters after every step (and the
localiser its forced parameters and gradients), and how the parent reads them back.

A `torch.save` of a dict of tensors read back with `weights_only=True` pays per tensor (a storage
record, a rebuild, a fake-mode lookup), so reading a run's snapshots costs more than making them, where
the parent reads each snapshot several times over a matrix (reports/performance.md#snapshots-tables-and-checks).
Packed, the tensors of one dtype travel as one flat tensor beside their names and shapes, and come back as
views of it: one storage record per dtype, whatever the number of tensors. A file of the plain form (a dict)
is read as it is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import BinaryIO

import torch

_MARK = "fsdp-harness packed tensors v1"


def save_params(tensors: dict[str, torch.Tensor], path: Path | BinaryIO) -> None:
    """Write `tensors` to `path` (a file name or a binary file), packed per dtype."""
    names, shapes, kinds, flats, kind_of = [], [], [], [], {}
    for name, t in tensors.items():
        if t.dtype not in kind_of:
            kind_of[t.dtype] = len(flats)
            flats.append([])
        names.append(name)
        shapes.append(tuple(t.shape))
        kinds.append(kind_of[t.dtype])
        flats[kind_of[t.dtype]].append(t.detach().reshape(-1))
    packed = [torch.cat(parts) if len(parts) > 1 else parts[0].clone() for parts in flats]
    torch.save((_MARK, names, shapes, kinds, packed), path)


def load_params(path: Path) -> dict[str, torch.Tensor]:
    """What `save_params` wrote (each tensor a view of its dtype's flat tensor), or a plain saved dict."""
    loaded = torch.load(path, weights_only=True)
    if not (isinstance(loaded, tuple) and loaded and loaded[0] == _MARK):
        return loaded
    _, names, shapes, kinds, packed = loaded
    out, offsets = {}, [0] * len(packed)
    for name, shape, kind in zip(names, shapes, kinds):
        n = math.prod(shape)
        out[name] = packed[kind][offsets[kind] : offsets[kind] + n].view(shape)
        offsets[kind] += n
    return out
