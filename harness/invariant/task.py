"""The world task of the batch-invariant tier: one implementation trained through its own batch-invariant step
(the adapter's ``invariant_forward_backward``), the full parameters and the loss recorded after every step.

Every rank returns its losses; rank 0 also returns the full parameters after each step (fp32, CPU), as the
adapter's ``full_params`` gives them (collective). The batch of step s is the zoo model's seeded batch of the
global size, cut as the data mode cuts it: rank r's contiguous 1 / W with split data, the whole batch on every
rank with replicated data (the invariant mode's micro-batch index runs over contiguous slices, so the cut is made
here, not by harness.train.data.local_slice's strided one).

Features (FEATURES): ``bf16`` (the adapter's mixed-precision wrap, the loss taken in fp32), ``ac`` (activation
checkpointing on every unit before wrapping), ``clip_inf`` (the adapter's clip_grad_norm by the infinity norm
after each step's backward) and ``ckpt`` (steps `first`..`last`, from the checkpoint in `load`, saved to `save`).
"""

from __future__ import annotations

import torch

from harness.adapters import load_adapter
from harness.core.features import REGISTRY, has
from harness.train.models import get_model_spec

FEATURES = ("plain", "bf16", "ac", "clip_inf", "ckpt")


def train_invariant(ctx, p: dict) -> dict:
    """`p`: impl, model, optimizer, data_mode, micro (L), steps, seed, lr, global_batch, feature; for ckpt
    `first`, `last`, `load`, `save`."""
    from harness.train.features import checkpoint_units, wrap_for

    adapter = load_adapter(p["impl"])
    if not callable(getattr(adapter, "invariant_forward_backward", None)):
        return {
            "unsupported": f"adapter '{adapter.name}' has no invariant_forward_backward() method, which the "
            f"batch-invariant tier needs (see harness/adapters/base.py)"
        }
    feature = p.get("feature", "plain")
    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    model = spec.build()
    units = spec.units(model)
    if has(feature, "ac"):
        checkpoint_units(units)
    wrapped = wrap_for("bf16" if has(feature, "bf16") else "plain", adapter, model, units, ctx=ctx)
    optimizer = adapter.make_optimizer(wrapped, name=p["optimizer"], lr=p["lr"])
    if p.get("load"):
        adapter.load_checkpoint(wrapped, optimizer, p["load"])
    loss_fn = (lambda out, y: spec.loss(out.float(), y)) if has(feature, "bf16") else spec.loss
    replicated = p["data_mode"] == "replicated"
    losses, params = [], []
    for step in range(p.get("first", 1), p.get("last", p["steps"]) + 1):
        x, y = spec.make_batch(p["global_batch"], step, p["seed"])
        if not replicated:
            n = x.shape[0] // ctx.world_size
            x, y = x[ctx.rank * n : (ctx.rank + 1) * n], y[ctx.rank * n : (ctx.rank + 1) * n]
        x, y = x.to(ctx.device), y.to(ctx.device)
        loss = adapter.invariant_forward_backward(
            wrapped, loss_fn, x, y, micro_batches=p["micro"], replicated=replicated
        )
        adapter.after_backward(wrapped, optimizer)
        if has(feature, "clip_inf"):
            norm_type, max_norm = REGISTRY["clip_inf"].clip
            adapter.clip_grad_norm(wrapped, max_norm, norm_type)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        full = adapter.full_params(wrapped)  # collective: every rank calls it
        if ctx.rank == 0:
            params.append({k: v.detach().to("cpu", torch.float32).clone() for k, v in full.items()})
    if p.get("save"):
        adapter.save_checkpoint(wrapped, optimizer, p["save"])
    return {"losses": losses, "params": params}
