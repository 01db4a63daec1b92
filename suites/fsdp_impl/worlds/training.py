"""fsdp_worlds tasks that train: sharded against plain numerics (with the classic sum-instead-of-
mean bug on demand), mixed precision, and training modes (reshard after forward, gradient
accumulation, eval between steps, a unit called twice, garbage in the padding rows).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_impl.group as fsdp_group
from fsdp_impl import clip_grad_norm_, fully_shard, set_requires_gradient_sync
from fsdp_impl.state import units
from harness.optimizers import make_optimizer
from harness.train.models import get_model_spec
from suites.fsdp_impl.worlds.common import (
    build,
    full_grads,
    local_batch,
    named_full,
    padding_max,
    patched,
    to_numpy,
)


def _sum_without_mean(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype, out_dtype=None) -> torch.Tensor:
    """The classic ZeRO bug: reduce-scatter with SUM and forget to divide by the world size.
    `full_grad`: the unit's send buffer, W rank chunks end to end."""
    world = dist.get_world_size(group)
    if world == 1:
        return full_grad.to(reduce_dtype)
    send = full_grad.to(reduce_dtype)
    out = torch.empty(send.numel() // world, dtype=reduce_dtype, device=send.device)
    dist.reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
    return out


# -------------------------------------------------------------------------------------- tasks


def train(ctx, p: dict) -> dict:
    """Train ``steps`` steps; return per-step local losses, the final full parameters (every rank),
    the worst padding value seen after any optimizer step, and the initial full parameters."""
    bug = (
        patched(fsdp_group, "reduce_scatter_mean", _sum_without_mean) if p.get("sum_bug") else contextlib.nullcontext()
    )
    with bug:
        model, spec = build(p, ctx)
        wrapped = p.get("wrap", True)
        initial = named_full(model, wrapped)
        opt = make_optimizer(model.parameters(), p.get("optimizer", "sgd"), p.get("lr", 0.05))
        losses, worst_pad = [], padding_max(model, ctx) if wrapped else 0.0
        for step in range(1, p.get("steps", 3) + 1):
            x, y = local_batch(spec, p, step, ctx)
            loss = spec.loss(model(x), y)
            loss.backward()
            grads = [(q.requires_grad, q.grad is not None) for q in model.parameters()]
            if wrapped:
                worst_pad = max(worst_pad, padding_max(model, ctx))  # after reduce-scatter
            opt.step()
            if wrapped:
                worst_pad = max(worst_pad, padding_max(model, ctx))  # after the optimizer step
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach().float()))
        return {
            "losses": losses,
            "params": named_full(model, wrapped),
            "initial": initial,
            "padding_max": worst_pad,
            "grads_after_backward": grads,
            "dtypes": sorted({str(q.dtype) for q in model.parameters()}),
        }


def mixed_precision(ctx, p: dict) -> dict:
    """Train with a policy; record the dtypes reduce_scatter_mean is called with, the dtype of
    every leaf module's output, the shards' dtypes, and the final full parameters."""
    calls: list[tuple[str, str]] = []
    real = fsdp_group.reduce_scatter_mean

    def spy(full_grad, group, reduce_dtype, out_dtype=None):
        calls.append((str(full_grad.dtype), str(reduce_dtype)))
        return real(full_grad, group, reduce_dtype, out_dtype)

    out_dtypes: set[str] = set()
    with patched(fsdp_group, "reduce_scatter_mean", spy):
        model, spec = build(p, ctx)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(lambda mod, a, out: out_dtypes.add(str(out.dtype)))
        opt = make_optimizer(model.parameters(), p.get("optimizer", "adamw"), p.get("lr", 0.02))
        losses = []
        for step in range(1, p.get("steps", 3) + 1):
            x, y = local_batch(spec, p, step, ctx)
            loss = spec.loss(model(x).float(), y)
            loss.backward()
            grad_dtypes = sorted({str(q.grad.dtype) for q in model.parameters() if q.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return {
        "reduce_calls": sorted(set(calls)),
        "out_dtypes": sorted(out_dtypes),
        "losses": losses,
        "shard_dtypes": sorted({str(q.dtype) for q in model.parameters()}),
        "grad_dtypes": grad_dtypes,
        "opt_state_dtypes": sorted(
            {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
        ),
        "params": named_full(model, True),
        "padding_max": padding_max(model, ctx),
    }


def handle_states_after_forward(ctx, p: dict) -> dict:
    """Per unit, after one training forward (before backward): each parameter's state and the bytes
    its unsharded storage holds; what state_dict() gives then (it reshards); the same after
    backward, and the gradients' types."""
    model, spec = build(p, ctx)
    x, y = local_batch(spec, p, 1, ctx)

    def snapshot():
        return {
            prefix or "<root>": [(q.state.name, q.unsharded_nbytes()) for q in state.params.params]
            for prefix, state in units(model)
        }

    loss = spec.loss(model(x), y)
    after_forward = snapshot()
    names = {n for n, _ in model.named_parameters()}
    in_state_dict = sorted({type(v).__name__ for k, v in model.state_dict().items() if k in names})
    loss.backward()  # after state_dict() resharded every unit: backward gathers them again
    return {
        "after_forward": after_forward,
        "after_backward": snapshot(),
        "state_dict_types": in_state_dict,
        "grads": sorted({type(q.grad).__name__ for q in model.parameters()}),
    }


def resharded_to_a_group(ctx, p: dict) -> dict:
    """reshard_after_forward=p["reshard"] (an int): per unit after one forward, each parameter's state and
    unsharded bytes, the elements its post-forward block keeps and its padded shard's; the all-gathers that
    backward issues by the size of their group (harness's CommCounter); what is kept after backward."""
    from harness.measure.comm import CommCounter

    model, spec = build(p, ctx)
    x, y = local_batch(spec, p, 1, ctx)
    loss = spec.loss(model(x), y)
    after_forward = {
        prefix or "<root>": {
            "handles": [(q.state.name, q.unsharded_nbytes()) for q in state.params.params],
            "kept": sum(t.numel() for t in (state.params._kept or {}).values()),
            "shard": sum(q.shard_numel for q in state.params.params),
        }
        for prefix, state in units(model)
    }
    with CommCounter() as cc:
        loss.backward()
    gathers = {}
    for row in cc.summary():
        if row["collective"] == "all_gather":
            gathers[row["ranks"]] = gathers.get(row["ranks"], 0) + row["elements"]
    return {
        "after_forward": after_forward,
        "backward_gathers": gathers,
        "kept_after_backward": [prefix for prefix, state in units(model) if state.params._kept],
    }


def placements(ctx, p: dict) -> dict:
    """name -> (the DTensor's placement, its local shape) after fully_shard."""
    model, _ = build(p, ctx)
    return {n: (f"Shard({q.placements[0].dim})", list(q._local_tensor.shape)) for n, q in model.named_parameters()}


def refused(ctx, p: dict) -> str:
    """build() with the payload's options: the ValueError's text ('' if it built)."""
    try:
        build(p, ctx)
    except ValueError as exc:
        return str(exc)
    return ""


def grad_accumulation(ctx, p: dict) -> dict:
    """Gradients after (a) two backward calls on the two halves of a batch, each loss halved, (b) one
    backward on the whole batch, and (c) as (a) with the reduction switched off for the first half
    (set_requires_gradient_sync); for a sharded and for the plain model."""
    spec = get_model_spec(p["model"])
    x, y = spec.make_batch(p.get("batch", 8), 1, 0)
    half = x.shape[0] // 2
    out = {}
    for wrapped in (True, False):
        for mode in ("accumulated", "whole", "no_sync"):
            model, _ = build({**p, "wrap": wrapped}, ctx)
            sync = (lambda on: set_requires_gradient_sync(model, on)) if wrapped else (lambda on: None)
            if mode == "whole":
                spec.loss(model(x), y).backward()
            else:
                sync(mode != "no_sync")  # no_sync: the first half's gradient stays unreduced
                (spec.loss(model(x[:half]), y[:half]) * 0.5).backward()
                if mode == "no_sync" and wrapped:
                    out["no_sync_reduced_early"] = any(q.grad is not None for q in model.parameters())
                sync(True)
                (spec.loss(model(x[half:]), y[half:]) * 0.5).backward()
            if wrapped:
                grads = full_grads(model)
            else:
                grads = {n: to_numpy(q.grad) for n, q in model.named_parameters() if q.grad is not None}
            out[f"{'fsdp' if wrapped else 'plain'}_{mode}"] = grads
    return out


def eval_no_grad(ctx, p: dict) -> dict:
    """Forward under no_grad (eval mode) between training steps; sharded and plain alike."""
    model, spec = build(p, ctx)
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    evals = []
    full_bytes_after_eval = 0
    for step in range(1, 4):
        x, y = local_batch(spec, p, step, ctx)
        spec.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evals.append(to_numpy(model(x)))
        model.train()
        if p.get("wrap", True):
            full_bytes_after_eval = max(
                [full_bytes_after_eval] + [q.unsharded_nbytes() for _, st in units(model) for q in st.params.params]
            )
    return {
        "evals": evals,
        "params": named_full(model, p.get("wrap", True)),
        "full_bytes_after_eval": full_bytes_after_eval,
    }


class CallsChildTwice(nn.Module):
    """``inner`` (its own unit) runs twice per forward; ``pre`` makes backward need inner's weight
    for both calls (the gradient must flow through the first call to reach ``pre``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.inner, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(self.pre(x))))))


def unit_called_twice(ctx, p: dict) -> dict:
    torch.manual_seed(0)
    model = CallsChildTwice()
    if p["wrap"]:
        fully_shard(model.inner, process_group=ctx.group, reshard_after_forward=p["reshard"])
        fully_shard(model, process_group=ctx.group, reshard_after_forward=p["reshard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"params": named_full(model, p["wrap"])}


def padding_garbage(ctx, p: dict) -> dict:
    """Write garbage into every sharded parameter's padding rows before each step (as a careless
    writer could; the optimizer never touches them): the gathers send it and the copy-out must drop
    it, so that no parameter and no gradient ever sees it. Returns how many elements were written,
    whether any gathered parameter or any gradient held the garbage value, and the final parameters."""
    model, spec = build(p, ctx)
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    corrupted, found = 0, []

    def look(mod, args):
        found.extend(bool((q.detach() == 7.0).any()) for q in mod.parameters(recurse=False))

    hooks = [m.register_forward_pre_hook(look) for m in model.modules() if not list(m.children())]
    for step in range(1, 4):
        with torch.no_grad():
            for _, state in units(model):
                for q in state.params.params:
                    q.padded[q.local_numel :] = 7.0
                    corrupted += q.padded.numel() - q.local_numel
        x, y = local_batch(spec, p, step, ctx)
        spec.loss(model(x), y).backward()
        found.extend(bool((g == 7.0).any()) for g in full_grads(model).values())
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    return {"corrupted": corrupted, "seen": any(found), "looked": len(found), "params": named_full(model, True)}


def clipped(ctx, p: dict) -> dict:
    """The global norm fsdp_impl.clip_grad_norm_ (``via: torch``: torch's own clip_grad_norm_ on the
    DTensor gradients) reports and the gradients it leaves, for the sharded model and for the plain
    model clipped by torch, on the same batch (replicated data)."""
    spec = get_model_spec(p["model"])
    x, y = spec.make_batch(p.get("batch", 8), 1, 0)
    out = {}
    for wrapped in (True, False):
        model, _ = build({**p, "wrap": wrapped}, ctx)
        spec.loss(model(x), y).backward()
        if wrapped and p.get("via") == "torch":  # torch's own function on the DTensor gradients
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p["max_norm"], p["norm_type"])
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            out["fsdp"] = (float(norm), full_grads(model))
        elif wrapped:
            norm = clip_grad_norm_(model, p["max_norm"], p["norm_type"])
            out["fsdp"] = (float(norm), full_grads(model))
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p["max_norm"], p["norm_type"])
            out["plain"] = (float(norm), {n: to_numpy(q.grad) for n, q in model.named_parameters()})
    return out


class CheckpointAroundUnit(nn.Module):
    """``inner`` (its own unit) runs under a non-reentrant activation checkpoint that wraps the
    unit's whole call, hooks included (as ``checkpoint(module, x)`` does): the recomputation in
    backward calls the unit again while the backward is running."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.inner, self.out = nn.Linear(6, 7), nn.Linear(7, 7), nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.pre(x))
        return self.out(torch.tanh(checkpoint(self.inner, h, use_reentrant=False)))


def checkpoint_around_unit(ctx, p: dict) -> dict:
    """Three SGD steps of CheckpointAroundUnit (plain or sharded); with ``wrap`` the gradient
    reductions per step are counted."""
    torch.manual_seed(0)
    model = CheckpointAroundUnit()
    if p["wrap"]:
        fully_shard(model.inner, process_group=ctx.group)
        fully_shard(model, process_group=ctx.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    calls = []
    real = fsdp_group.ParamGroup.reduce_grads

    def count(self):  # a reduction: a unit's reduce_grads with gradients to reduce (one rank reduces none apart)
        if any(q.requires_grad and q.unsharded_grad() is not None for q in self.params):
            calls.append(1)
        return real(self)

    with patched(fsdp_group.ParamGroup, "reduce_grads", count):
        for _ in range(3):
            model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return {"params": named_full(model, p["wrap"]), "reductions": len(calls)}
