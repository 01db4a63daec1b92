"""What every fsdp_worlds task shares: the seeded model, sharded by fsdp_impl unless asked not
to be, this rank's batch, full parameters as numpy arrays, and the worst value in the padding.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from fsdp_impl import MixedPrecisionPolicy, full_state_dict, fully_shard
from fsdp_impl.api import units
from harness.train.models import get_model_spec

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, None: None}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().copy()


def named_full(model: nn.Module, wrapped: bool) -> dict[str, np.ndarray]:
    """Full parameters by unwrapped name: fsdp_impl's full_state_dict, or the plain model's own."""
    params = full_state_dict(model) if wrapped else dict(model.named_parameters())
    return {k: to_numpy(v) for k, v in params.items()}


def shard_model(model: nn.Module, unit_list: list[nn.Module], group, *, reshard: bool = True,
                mp: dict | None = None) -> nn.Module:
    policy = None
    if mp is not None:
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[mp.get("param_dtype")],
                                      reduce_dtype=DTYPES[mp.get("reduce_dtype")])
    for unit in unit_list:
        fully_shard(unit, process_group=group, reshard_after_forward=reshard, mp_policy=policy)
    return fully_shard(model, process_group=group, reshard_after_forward=reshard, mp_policy=policy)


def build(p: dict, ctx) -> tuple[nn.Module, Any]:
    """Seeded model (frozen parameters as asked), sharded unless ``wrap`` is False."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    for name in p.get("frozen", ()):
        model.get_parameter(name).requires_grad_(False)
    if p.get("wrap", True):
        units_ = spec.units(model) if p.get("units", True) else []
        shard_model(model, units_, ctx.group, reshard=p.get("reshard", True), mp=p.get("mp"))
    return model, spec


def _local_padding(h, rank: int) -> torch.Tensor:
    """Mask over this rank's shard of handle `h`: True where the padded flat buffer lies in no
    slot (alignment gap or tail), recomputed from the slots."""
    mask = torch.ones(h.layout.padded_numel, dtype=torch.bool)
    for slot in h.layout.slots:
        mask[slot.offset:slot.end] = False
    n = h.layout.shard_numel
    return mask[rank * n:(rank + 1) * n]


def padding_max(model: nn.Module, ctx) -> float:
    """max |value| over this rank's padding elements of every shard and shard gradient.

    Padding is recomputed here from the slots: an element of the padded flat buffer that lies
    in no slot (alignment gap or tail)."""
    worst = 0.0
    for _, state in units(model):
        for h in state.handles:
            local = _local_padding(h, ctx.rank)
            for t in (h.shard, h.shard.grad):
                if t is not None and local.any():
                    worst = max(worst, float(t.detach()[local].abs().max()))
    return worst


def local_batch(spec, p: dict, step: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = spec.make_batch(p.get("batch", 8), step, p.get("seed", 0))
    if p.get("data_mode", "replicated") == "split" and p.get("wrap", True):
        x, y = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
    return x, y


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
