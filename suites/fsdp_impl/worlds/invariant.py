"""fsdp_worlds tasks for batch-invariant training (fsdp_impl.invariant): fsdp_impl at any world size with
split data, and the plain model summing the same micro-batches in the same tree (the reference: the harness's
recursive halving over the micro-batch index, harness.adapters.reference.tree_sum, apart from fsdp_impl's
TreeSum)."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_impl import clip_grad_norm_
from fsdp_impl.invariant import invariant_forward_backward
from harness.adapters.reference import tree_sum as tree
from harness.optimizers import make_optimizer
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import named_full, shard_model


def plain_tree_step(model: nn.Module, loss_fn, x, y, micro: int) -> torch.Tensor:
    """The plain model's step: `micro` equal micro-batches of the whole batch, each loss / micro, every
    parameter's gradients and the losses summed in the tree."""
    size = x.shape[0] // micro
    grads: dict[nn.Parameter, list] = {q: [] for q in model.parameters()}
    losses = []
    for i in range(micro):
        loss = loss_fn(model(x[i * size : (i + 1) * size]), y[i * size : (i + 1) * size]) / micro
        loss.backward()
        losses.append(loss.detach())
        for q in grads:
            grads[q].append(q.grad)
            q.grad = None
    for q, gs in grads.items():
        q.grad = tree(gs)
    return tree(losses)


def train(ctx, p: dict) -> dict:
    """`steps` steps at batch `batch` with `micro` micro-batches; ``wrap`` False: the plain tree reference at
    one rank; ``invariant`` False: fsdp_impl's default step on the same contiguous slice (for contrast)."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    wrap = p.get("wrap", True)
    if p.get("ac"):  # activation checkpointing on every unit, before any wrapping (as the harness applies it)
        from harness.train.features import checkpoint_units

        checkpoint_units(spec.units(model))
    plain = model
    if wrap:
        shard_model(
            model,
            spec.units(model),
            ctx.group,
            mp={"param_dtype": "bfloat16", "reduce_dtype": "float32"} if p.get("bf16") else None,
        )
    elif p.get("bf16"):  # the plain model under the same policy, written out apart from fsdp_impl
        from harness.adapters.reference import MixedPrecision

        model = MixedPrecision(model, torch.bfloat16)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), 1e-2)
    losses = []
    for step in range(1, p.get("steps", 3) + 1):
        x, y = spec.make_batch(p.get("batch", 16), step, p.get("seed", 0))
        loss_fn = (lambda out, t: spec.loss(out.float(), t)) if p.get("bf16") else spec.loss
        if not wrap:
            loss = plain_tree_step(model, loss_fn, x, y, p["micro"])
        else:
            replicated = p.get("data_mode") == "replicated"
            if not replicated:
                n = x.shape[0] // ctx.world_size
                x, y = x[ctx.rank * n : (ctx.rank + 1) * n], y[ctx.rank * n : (ctx.rank + 1) * n]
            if p.get("invariant", True):
                loss = invariant_forward_backward(model, loss_fn, x, y, micro_batches=p["micro"], replicated=replicated)
            else:
                loss = spec.loss(model(x), y)
                loss.backward()
        if p.get("clip2"):  # the batch-invariant L2 norm: fsdp_impl's, and the same formula on the plain model
            if wrap:
                clip_grad_norm_(model, p["clip2"], 2.0, batch_invariant=True)
            else:
                from fsdp_impl.clip import row_norm_sq

                grads = [q.grad for q in model.parameters() if q.grad is not None]
                total = row_norm_sq(grads).sqrt().float()
                coef = torch.clamp(p["clip2"] / (total + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coef)
        if p.get("clip_inf"):
            if wrap:
                clip_grad_norm_(model, p["clip_inf"], float("inf"))
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), p["clip_inf"], float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "params": named_full(model if wrap else plain, wrap)}


def train_part(ctx, p: dict) -> dict:
    """Steps `first`..`last` of the invariant run at this world size: from the seeded model (first = 1) or from
    the checkpoint in `load` (fsdp_impl.load_sharded, saved at another world size); saved to `save` after."""
    from fsdp_impl import load_sharded, save_sharded

    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    model = spec.build()
    shard_model(model, spec.units(model), ctx.group)
    opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), 1e-2)
    if p.get("load"):
        load_sharded(model, opt, p["load"])
    losses = []
    for step in range(p["first"], p["last"] + 1):
        x, y = spec.make_batch(p.get("batch", 16), step, p.get("seed", 0))
        n = x.shape[0] // ctx.world_size
        x, y = x[ctx.rank * n : (ctx.rank + 1) * n], y[ctx.rank * n : (ctx.rank + 1) * n]
        loss = invariant_forward_backward(model, spec.loss, x, y, micro_batches=p["micro"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    if p.get("save"):
        save_sharded(model, opt, p["save"])
    return {"losses": losses, "params": named_full(model, True)}
