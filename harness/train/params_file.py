"""Named tensors in one file, packed: how rank 0 writes the full parameters after every step, each rank its part of
a step's gradient digest (and the localiser its forced parameters and gradients), and how the parent reads them
back.

The parent reads thousands of these files over a matrix, while the ranks train beside it, so a file is made to
cost little to read: a short text header (a JSON list of names, shapes and dtypes) and, per dtype, the tensors'
bytes one after the other; read back, each tensor is a view of its dtype's flat tensor, made from the file's
bytes with no unpickling. A `torch.save`d file read with `weights_only=True` pays per file (the unpickler, a
storage record) about ten times what this format does (reports/performance.md#snapshots-tables-and-checks).
The bytes are this machine's order: the files are read by the run that wrote them, on its machine. A file
`torch.save`d as a dict of tensors, or in this module's earlier pickled form, is read as it is.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import BinaryIO

import torch

_MAGIC = b"fsdp-harness tensors v2\n"
_ALIGN = 8  # each dtype's bytes start at a multiple of this in the file (and in the buffer read back)
_PICKLED = "fsdp-harness packed tensors v1"  # the earlier form: torch.save((_PICKLED, names, shapes, kinds, flats))


def save_params(tensors: dict[str, torch.Tensor], path: Path | BinaryIO) -> None:
    """Write `tensors` to `path` (a file name or a binary file), packed per dtype."""
    names, shapes, kinds, flats, kind_of = [], [], [], [], {}
    for name, t in tensors.items():
        if t.dtype not in kind_of:
            kind_of[t.dtype] = len(flats)
            flats.append([])
        names.append(name)
        shapes.append(list(t.shape))
        kinds.append(kind_of[t.dtype])
        flats[kind_of[t.dtype]].append(t.detach().reshape(-1))
    # new tensors with unit stride (a lone one may be a view with any stride: an expanded scalar, an empty slice)
    packed = [
        (torch.cat(parts) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)).cpu()
        for parts in flats
    ]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in packed]
    header = json.dumps(
        {"byteorder": sys.byteorder, "names": names, "shapes": shapes, "kinds": kinds, "dtypes": dtypes}
    ).encode()
    header += b" " * (-(len(_MAGIC) + 8 + len(header)) % _ALIGN)
    parts = [_MAGIC, len(header).to_bytes(8, "little"), header]
    for t in packed:
        raw = t.view(torch.uint8).numpy() if t.numel() else b""  # the tensor's own bytes, written without a copy
        parts += [raw, b"\0" * (-t.numel() * t.element_size() % _ALIGN)]
    if isinstance(path, (str, Path)):
        with open(path, "wb") as f:
            f.writelines(parts)
    else:
        path.writelines(parts)


def load_params(path: Path) -> dict[str, torch.Tensor]:
    """What `save_params` wrote (each tensor a view of its dtype's flat tensor), or a plain saved dict."""
    with open(path, "rb") as f:
        data = bytearray(f.read())  # writable: the tensors are views of it
    if not data.startswith(_MAGIC):
        return _load_pickled(data)
    start = len(_MAGIC) + 8
    end = start + int.from_bytes(data[len(_MAGIC) : start], "little")
    header = json.loads(bytes(data[start:end]))
    if header["byteorder"] != sys.byteorder:
        raise ValueError(f"{path} was written on a {header['byteorder']}-endian machine; this one is {sys.byteorder}")
    counts = [0] * len(header["dtypes"])
    for shape, kind in zip(header["shapes"], header["kinds"]):
        counts[kind] += math.prod(shape)
    packed, offset = [], end
    for name, n in zip(header["dtypes"], counts):
        dtype = getattr(torch, name)
        size = n * dtype.itemsize
        packed.append(torch.frombuffer(data, dtype=dtype, count=n, offset=offset) if n else torch.empty(0, dtype=dtype))
        offset += size + (-size % _ALIGN)
    return _views(header["names"], header["shapes"], header["kinds"], packed)


def _views(names, shapes, kinds, packed) -> dict[str, torch.Tensor]:
    out, offsets = {}, [0] * len(packed)
    for name, shape, kind in zip(names, shapes, kinds):
        n = math.prod(shape)
        out[name] = packed[kind][offsets[kind] : offsets[kind] + n].view(shape)
        offsets[kind] += n
    return out


def _load_pickled(data: bytearray) -> dict[str, torch.Tensor]:
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    if not (isinstance(loaded, tuple) and loaded and loaded[0] == _PICKLED):
        return loaded
    _, names, shapes, kinds, packed = loaded
    return _views(names, shapes, kinds, packed)
