"""The files of a sharded checkpoint (checkpoint.py), their checks, and the reader that reshards.

Every file is a ``torch.save`` of plain containers, tensors, dtypes and numbers (loadable with
``weights_only=True``), and carries ``format`` and the save's ``save_id``.

``shard-RRRRR-of-WWWWW.pt`` (saved rank R of W): ``world_size``, ``rank`` and ``handles``, by the
shard's parameter name ('<unit>._fsdp_flat_param<i>'): ``prefix``, ``index``, ``range`` (the rank's
[lo, hi) of the padded flat buffer), ``used_numel``, ``slots`` ((fqn, shape, offset, numel) each),
``dtype``, ``param`` (the shard's elements below used_numel: length max(0, min(hi, used) - lo)) and
``state``: None, or ``keys`` (the optimizer state's keys, in order), ``scalars`` (0-dim and
non-tensor values, copied as they are), ``sharded`` (key -> the same cut as ``param``) and
``dtypes`` (key -> dtype of the sharded tensors).

``plain.pt`` (rank 0; only with parameters outside every unit): ``params`` (name -> the whole
tensor) and ``state`` (name -> its optimizer state, whole).

``meta.pt`` (rank 0, written last): ``world_size``; ``units`` (prefix, ``handles``: each shard
entry without its tensors, plus ``name`` and ``shard_numel``; from rank 0, whose scalar state
stands for every rank's); ``plain`` (name -> (shape, dtype)); ``optimizer``: None (saved without
one), or ``type`` (the optimizer's class name) and ``param_groups`` (the hyper-parameters,
``params`` as parameter names).
"""

from __future__ import annotations

import os

import torch

FORMAT = "fsdp_impl.sharded_checkpoint/1"
META = "meta.pt"
PLAIN = "plain.pt"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


# --------------------------------------------------------------------------------- writing

def atomic_save(obj: dict, path: str) -> None:
    """torch.save under a temporary name, flushed to disk, then renamed: `path` is complete or absent."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        remove_if_present(tmp)


def remove_if_present(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _cut(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first n elements as a tensor of their own: torch.save writes a view's whole storage."""
    t = t.detach()
    return t[:n].clone().cpu() if n < t.numel() else t.cpu()


def shard_entry(prefix: str, index: int, h, name: str, state: dict | None) -> dict:
    """What this rank saves of handle `h` (and of its optimizer state, None if the optimizer does
    not hold the shard)."""
    lo, hi = h.layout.rank_range(h.rank)
    n = max(0, min(hi, h.layout.used_numel) - lo)
    entry = {"prefix": prefix, "index": index, "range": (lo, hi), "used_numel": h.layout.used_numel,
             "slots": [(s.fqn, s.shape, s.offset, s.numel) for s in h.layout.slots], "dtype": h.dtype,
             "param": _cut(h.shard, n), "state": None}
    if state:  # None (not in the optimizer) or {} (no step yet): nothing to restore
        scalars, sharded = {}, {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                if tuple(v.shape) != tuple(h.shard.shape):
                    raise ValueError(f"save_sharded: optimizer state '{k}' of '{name}' has shape {tuple(v.shape)}, "
                                     f"neither the shard's {tuple(h.shard.shape)} nor 0-dim: it cannot be resharded")
                sharded[k] = _cut(v, n)
            else:
                scalars[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
        entry["state"] = {"keys": list(state), "scalars": scalars, "sharded": sharded,
                          "dtypes": {k: v.dtype for k, v in sharded.items()}}
    return entry


def plain_file(save_id: str, plain: list, optimizer, held: set) -> dict:
    """Parameters outside every unit, whole, with their optimizer state (those the optimizer holds)."""
    state = {}
    if optimizer is not None:
        for n, p in plain:
            if p in held and optimizer.state.get(p):
                state[n] = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
    return {"format": FORMAT, "save_id": save_id, "params": {n: p.detach().cpu() for n, p in plain},
            "state": state}


def meta_file(save_id: str, world_size: int, shard_file: dict, plain: list, optimizer,
              names: dict[int, str]) -> dict:
    """Rank 0's description of the whole checkpoint, from its own shard file's entries."""
    by_unit: dict[str, list] = {}
    for name, e in shard_file["handles"].items():
        st = e["state"]
        desc = {**{k: v for k, v in e.items() if k not in ("param", "state")}, "name": name,
                "shard_numel": e["range"][1] - e["range"][0],
                "state": None if st is None else {k: v for k, v in st.items() if k != "sharded"}}
        by_unit.setdefault(e["prefix"], []).append(desc)
    groups = None
    if optimizer is not None:
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
    return {"format": FORMAT, "save_id": save_id, "world_size": world_size,
            "units": [{"prefix": p, "handles": hs} for p, hs in by_unit.items()],
            "plain": {n: (tuple(p.shape), p.dtype) for n, p in plain},
            "optimizer": None if groups is None else {"type": type(optimizer).__name__, "param_groups": groups}}


# --------------------------------------------------------------------------------- checks

def _load(path: str, what: str) -> dict:
    if not os.path.exists(path):
        raise ValueError(f"load_sharded: {what} {path} does not exist")
    obj = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"load_sharded: {path} is not an fsdp_impl sharded checkpoint file ({FORMAT})")
    return obj


def read_meta(path: str) -> dict:
    """meta.pt, or a ValueError saying there is no complete checkpoint at `path`."""
    meta_path = os.path.join(path, META)
    if not os.path.exists(meta_path):
        raise ValueError(f"load_sharded: no complete checkpoint at {path} ({META} is missing)")
    return _load(meta_path, "metadata file")


def _short(items) -> str:
    items = sorted(items)
    return ", ".join(repr(i) for i in items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")


def check_layout(meta: dict, handles: list, module, path: str) -> None:
    """Same units, as many handles in each, the same slots (name, shape, offset) in each handle,
    the same parameters outside every unit: else one ValueError naming the first difference."""
    where = f"the checkpoint at {path}"
    saved = {u["prefix"]: u["handles"] for u in meta["units"]}
    here: dict[str, list] = {}
    for name, prefix, _, h in handles:
        here.setdefault(prefix, []).append((name, h))
    if set(saved) != set(here):
        missing, extra = set(saved) - set(here), set(here) - set(saved)
        raise ValueError(f"load_sharded: a different model: units with parameters differ from {where} "
                         f"(only in the checkpoint: {_short(missing) or 'none'}; only here: {_short(extra) or 'none'})")
    for prefix, hs in here.items():
        if len(hs) != len(saved[prefix]):
            raise ValueError(f"load_sharded: unit '{prefix}' has {len(hs)} flat parameter(s) here but "
                             f"{len(saved[prefix])} in {where} (a different model, or other parameters frozen)")
        for (name, h), entry in zip(hs, saved[prefix]):
            mine = [(s.fqn, tuple(s.shape), s.offset, s.numel) for s in h.layout.slots]
            theirs = [(f, tuple(shape), off, n) for f, shape, off, n in entry["slots"]]
            if mine != theirs:
                i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                a = mine[i][:2] if i < len(mine) else "nothing"
                b = theirs[i][:2] if i < len(theirs) else "nothing"
                raise ValueError(f"load_sharded: a different model: '{name}' slot {i} is {a} here but {b} in {where}")
    plain = {n: tuple(p.shape) for n, p in module.named_parameters() if not getattr(p, "_fsdp_shard", False)}
    theirs = {n: tuple(shape) for n, (shape, _) in meta["plain"].items()}
    if plain != theirs:
        diff = {n for n in set(plain) | set(theirs) if plain.get(n) != theirs.get(n)}
        raise ValueError(f"load_sharded: a different model: parameters outside every unit differ from {where}: "
                         f"{_short(diff)}")


def check_optimizer(meta: dict, optimizer, names: dict[int, str], path: str) -> None:
    """The checkpoint holds optimizer state, in as many param groups, each over the same parameters."""
    if meta["optimizer"] is None:
        raise ValueError(f"load_sharded: the checkpoint at {path} holds no optimizer state "
                         f"(saved with optimizer=None); pass optimizer=None to load the parameters only")
    kind = type(optimizer).__name__
    if meta["optimizer"]["type"] != kind:
        raise ValueError(f"load_sharded: the checkpoint at {path} holds the state of a {meta['optimizer']['type']} "
                         f"optimizer, not of a {kind}")
    saved = meta["optimizer"]["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"load_sharded: the optimizer has {len(optimizer.param_groups)} param group(s), "
                         f"the checkpoint at {path} {len(saved)}")
    for g, (group, theirs) in enumerate(zip(optimizer.param_groups, saved)):
        mine = [names[id(p)] for p in group["params"]]
        if sorted(mine) != sorted(theirs["params"]):
            diff = set(mine) ^ set(theirs["params"])
            raise ValueError(f"load_sharded: optimizer param group {g} holds other parameters than in the "
                             f"checkpoint at {path}: {_short(diff) or 'a parameter listed twice'}")


def check_files_exist(meta: dict, path: str) -> None:
    """Every saved rank's file (and plain.pt if needed) is there: checked by every rank alike."""
    w = meta["world_size"]
    missing = [shard_name(r, w) for r in range(w) if not os.path.exists(os.path.join(path, shard_name(r, w)))]
    if meta["plain"] and not os.path.exists(os.path.join(path, PLAIN)):
        missing.append(PLAIN)
    if missing:
        raise ValueError(f"load_sharded: the checkpoint at {path} (saved by {w} ranks) is missing {_short(missing)}")


# --------------------------------------------------------------------------------- reading

class ShardReader:
    """Opens (memory-mapped, once each) only the saved files a rank's new ranges overlap."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        self._open: dict[int, dict] = {}

    def _file(self, rank: int) -> dict:
        if rank not in self._open:
            w = self.meta["world_size"]
            f = os.path.join(self.path, shard_name(rank, w))
            obj = _load(f, "shard file")
            if obj.get("save_id") != self.meta["save_id"] or obj.get("world_size") != w or obj.get("rank") != rank:
                raise ValueError(f"load_sharded: {f} belongs to another save than {META} (a save was interrupted?)")
            self._open[rank] = obj
        return self._open[rank]

    def rebuild(self, entry: dict, h, want_state: bool) -> tuple[torch.Tensor, dict | None]:
        """This rank's new shard of the handle saved as `entry` (its length, zero beyond the saved
        elements), and its sharded optimizer state (None if not wanted or none saved)."""
        used, s = entry["used_numel"], entry["shard_numel"]
        lo, hi = h.layout.rank_range(h.rank)
        top = min(hi, used)
        spec = entry["state"] if want_state else None
        value = torch.zeros(h.layout.shard_numel, dtype=entry["dtype"])
        sharded = None if spec is None else {k: torch.zeros(h.layout.shard_numel, dtype=dt)
                                             for k, dt in spec["dtypes"].items()}
        overlapping = range(lo // s, -(-top // s)) if top > lo else range(0)  # saved ranks to read
        for r in overlapping:
            saved = self._file(r)["handles"].get(entry["name"])
            if saved is None:
                raise ValueError(f"load_sharded: {shard_name(r, self.meta['world_size'])} lacks '{entry['name']}'")
            a, b = max(lo, r * s), min(top, (r + 1) * s)
            value[a - lo:b - lo] = saved["param"][a - r * s:b - r * s]
            for k, t in (sharded or {}).items():
                pieces = (saved["state"] or {}).get("sharded", {})
                if k not in pieces:
                    raise ValueError(f"load_sharded: {shard_name(r, self.meta['world_size'])} lacks the "
                                     f"optimizer state '{k}' of '{entry['name']}'")
                t[a - lo:b - lo] = pieces[k][a - r * s:b - r * s]
        for t in [value, *(sharded or {}).values()]:
            h.zero_padding_(t)  # alignment gaps too: whatever the saving run left there
        if sharded is None:
            return value.to(h.device), None
        # the saved order of keys; scalars (Adam's step) stay on the CPU, where they were saved, as
        # torch keeps them (Optimizer.load_state_dict moves them itself where fused/capturable asks)
        state = {k: sharded[k].to(h.device) if k in sharded else _fresh(spec["scalars"][k]) for k in spec["keys"]}
        return value.to(h.device), state

    def plain(self) -> dict[str, dict]:
        """The parameters outside every unit (``params``, by name) and their optimizer state (``state``),
        copied out of plain.pt."""
        if not self.meta["plain"]:
            return {"params": {}, "state": {}}
        f = os.path.join(self.path, PLAIN)
        obj = _load(f, "file")
        if obj.get("save_id") != self.meta["save_id"]:
            raise ValueError(f"load_sharded: {f} belongs to another save than {META} (a save was interrupted?)")
        return {"params": {n: v.clone() for n, v in obj["params"].items()},
                "state": {n: {k: _fresh(v) for k, v in st.items()} for n, st in obj["state"].items()}}

    def close(self) -> None:
        self._open.clear()


def _fresh(v):
    """A tensor of its own (not a view of a memory-mapped file, not shared with the metadata)."""
    return v.clone() if torch.is_tensor(v) else v
