"""fsdp_worlds tasks on parameters that leave or enter a sharded model: a full state dict saved
and loaded (into a sharded and into a plain model), and meta-device init materialized by fsdp_impl.
"""

from __future__ import annotations

import torch

from fsdp_impl import full_state_dict, load_full_state_dict, materialize_meta
from harness.optimizers import make_optimizer
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import build, local_batch, padding_max, shard_model, to_numpy


def state_dict_round_trip(ctx, p: dict) -> dict:
    """Train a sharded model, save its full state dict, load it into a freshly sharded model of
    another seed, save again; also load it into a plain model by the unwrapped names (strict)
    and compare outputs of both models on one batch."""
    model, spec = build(p, ctx)
    opt = make_optimizer(model.parameters(), "adamw", 0.02)
    for step in range(1, 3):
        x, y = local_batch(spec, p, step, ctx)
        spec.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    saved = full_state_dict(model)
    fresh, _ = build({**p, "seed": p.get("seed", 0) + 1}, ctx)
    before = {k: to_numpy(v) for k, v in full_state_dict(fresh).items()}
    load_full_state_dict(fresh, saved)
    plain = spec.build()
    plain_names = [n for n, _ in plain.named_parameters()]  # unwrapped names, a tied weight once
    result = plain.load_state_dict(saved, strict=False)  # state_dict() also lists tied aliases
    x, _ = local_batch(spec, p, 99, ctx)
    with torch.no_grad():
        out_fresh, out_plain = fresh(x), plain(x)
    return {
        "saved": {k: to_numpy(v) for k, v in saved.items()},
        "before": before,
        "loaded": {k: to_numpy(v) for k, v in full_state_dict(fresh).items()},
        "out_fresh": to_numpy(out_fresh),
        "out_plain": to_numpy(out_plain),
        "padding_max": padding_max(fresh, ctx),
        "plain_names": plain_names,
        "missing": list(result.missing_keys),
        "unexpected": list(result.unexpected_keys),
    }


def meta_init(ctx, p: dict) -> dict:
    """Eager build with the seed vs meta build -> fully_shard -> seed -> materialize_meta."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    eager = spec.build()
    x, _ = spec.make_batch(4, 1, 0)
    with torch.no_grad():
        eager_out = to_numpy(eager(x))
    with torch.device("meta"):
        model = spec.build()
    shard_model(model, spec.units(model), ctx.group)
    torch.manual_seed(p["seed"])
    materialize_meta(model, "cpu")
    with torch.no_grad():
        out = to_numpy(model(x))
    return {
        "eager": {k: to_numpy(v) for k, v in eager.named_parameters()},
        "meta": {k: to_numpy(v) for k, v in full_state_dict(model).items()},
        "eager_out": eager_out,
        "meta_out": out,
        "devices": sorted({str(q.device) for q in model.parameters()}),
        "padding_max": padding_max(model, ctx),
    }
