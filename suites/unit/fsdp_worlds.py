"""Small multi-rank checks of fsdp_impl, run inside ``harness.execute.world.World`` workers.

Tests call ``world.run("suites.unit.fsdp_worlds:<task>", payload)``; each task builds a seeded
model on every rank, does its thing, and returns plain data (numpy arrays, floats, strings) so
that nothing but pickles crosses the pipe. The plain (non-sharded) reference runs through the
same tasks with ``wrap=False``, in the same kind of worker (one thread, deterministic algorithms),
so bitwise comparisons compare like with like.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import fsdp_impl.handle as fsdp_handle
from fsdp_impl import MixedPrecisionPolicy, full_state_dict, fully_shard, load_full_state_dict, materialize_meta
from fsdp_impl.api import units
from harness.train.models import get_model_spec
from harness.train.optim import make_optimizer

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, None: None}


# ------------------------------------------------------------------------------------ helpers

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


def _sum_without_mean(full_grad: torch.Tensor, group, reduce_dtype: torch.dtype) -> torch.Tensor:
    """The classic ZeRO bug: reduce-scatter with SUM and forget to divide by the world size."""
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
    bug = patched(fsdp_handle, "reduce_scatter_mean", _sum_without_mean) if p.get("sum_bug") \
        else contextlib.nullcontext()
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
        return {"losses": losses, "params": named_full(model, wrapped), "initial": initial,
                "padding_max": worst_pad, "grads_after_backward": grads,
                "dtypes": sorted({str(q.dtype) for q in model.parameters()})}


def layout(ctx, p: dict) -> dict:
    """After sharding: every unit's slot names/offsets, shard length, this rank's shard values;
    the model's parameter list; and the eager full parameters of the same seed (plain model)."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p.get("seed", 0))
    eager = {k: to_numpy(v) for k, v in spec.build().named_parameters()}
    model, _ = build(p, ctx)
    out_units = []
    for prefix, state in units(model):
        for h in state.handles:
            out_units.append({"prefix": prefix, "requires_grad": h.requires_grad,
                              "slots": [(s.fqn, s.offset, s.numel, s.shape) for s in h.layout.slots],
                              "shard_numel": h.layout.shard_numel, "shard": to_numpy(h.shard)})
    return {"units": out_units, "eager": eager,
            "params": [(n, tuple(q.shape), q.dim()) for n, q in model.named_parameters()],
            "numel_local": sum(q.numel() for q in model.parameters())}


def shared_across_units(ctx, case: str) -> str:
    """fully_shard two units that share one Parameter; return the error text ('' if none)."""
    torch.manual_seed(0)
    root = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    root[1].weight = root[0].weight
    try:
        if case == "siblings":
            fully_shard(root[0], process_group=ctx.group)
            fully_shard(root[1], process_group=ctx.group)
        else:  # a child, then the root that still holds the other tie
            fully_shard(root[0], process_group=ctx.group)
            fully_shard(root, process_group=ctx.group)
    except ValueError as exc:
        return str(exc)
    return ""


class WithBuffer(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 5)
        self.register_buffer("stat", torch.full((5,), float(rank) + 0.5))
        self.lin.register_buffer("inner", torch.arange(4.0) * (rank + 1))


def buffers(ctx, _: Any) -> dict:
    model = WithBuffer(ctx.rank)
    fully_shard(model.lin, process_group=ctx.group)
    fully_shard(model, process_group=ctx.group)
    return {n: to_numpy(b) for n, b in model.named_buffers()}


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
    return {"saved": {k: to_numpy(v) for k, v in saved.items()},
            "before": before,
            "loaded": {k: to_numpy(v) for k, v in full_state_dict(fresh).items()},
            "out_fresh": to_numpy(out_fresh), "out_plain": to_numpy(out_plain),
            "padding_max": padding_max(fresh, ctx), "plain_names": plain_names,
            "missing": list(result.missing_keys), "unexpected": list(result.unexpected_keys)}


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
    return {"eager": {k: to_numpy(v) for k, v in eager.named_parameters()},
            "meta": {k: to_numpy(v) for k, v in full_state_dict(model).items()},
            "eager_out": eager_out, "meta_out": out,
            "devices": sorted({str(q.device) for q in model.parameters()}),
            "padding_max": padding_max(model, ctx)}


def mixed_precision(ctx, p: dict) -> dict:
    """Train with a policy; record the dtypes reduce_scatter_mean is called with, the dtype of
    every leaf module's output, the shards' dtypes, and the final full parameters."""
    calls: list[tuple[str, str]] = []
    real = fsdp_handle.reduce_scatter_mean

    def spy(full_grad, group, reduce_dtype):
        calls.append((str(full_grad.dtype), str(reduce_dtype)))
        return real(full_grad, group, reduce_dtype)

    out_dtypes: set[str] = set()
    with patched(fsdp_handle, "reduce_scatter_mean", spy):
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
    return {"reduce_calls": sorted(set(calls)), "out_dtypes": sorted(out_dtypes), "losses": losses,
            "shard_dtypes": sorted({str(q.dtype) for q in model.parameters()}),
            "grad_dtypes": grad_dtypes,
            "opt_state_dtypes": sorted({str(v.dtype) for s in opt.state.values() for v in s.values()
                                        if torch.is_tensor(v) and v.dim() > 0}),
            "params": named_full(model, True), "padding_max": padding_max(model, ctx)}


def handle_states_after_forward(ctx, p: dict) -> dict:
    """Per unit, after one training forward (before backward): state and bytes of the full buffer.
    Then the same after backward."""
    model, spec = build(p, ctx)
    x, y = local_batch(spec, p, 1, ctx)

    def snapshot():
        return {prefix or "<root>": [(h.state.name, 0 if h.full is None else h.full.untyped_storage().nbytes())
                                     for h in state.handles] for prefix, state in units(model)}

    loss = spec.loss(model(x), y)
    after_forward = snapshot()
    loss.backward()
    return {"after_forward": after_forward, "after_backward": snapshot()}


def full_grads(model: nn.Module) -> dict[str, np.ndarray]:
    """Gather each handle's shard gradient (collective) and cut it by the slots."""
    out = {}
    for prefix, state in units(model):
        for h in state.handles:
            if h.shard.grad is None:
                continue
            full = torch.empty(h.layout.padded_numel, dtype=h.shard.grad.dtype)
            dist.all_gather_into_tensor(full, h.shard.grad.contiguous(), group=h.group)
            for s in h.layout.slots:
                out[f"{prefix}.{s.fqn}" if prefix else s.fqn] = to_numpy(full[s.offset:s.end].view(s.shape))
    return out


def grad_accumulation(ctx, p: dict) -> dict:
    """Gradients after (a) two backward calls on the two halves of a batch, each loss halved, and
    (b) one backward on the whole batch; for a sharded and for the plain model."""
    spec = get_model_spec(p["model"])
    x, y = spec.make_batch(p.get("batch", 8), 1, 0)
    half = x.shape[0] // 2
    out = {}
    for wrapped in (True, False):
        for mode in ("accumulated", "whole"):
            model, _ = build({**p, "wrap": wrapped}, ctx)
            if mode == "whole":
                spec.loss(model(x), y).backward()
            else:
                (spec.loss(model(x[:half]), y[:half]) * 0.5).backward()
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
            full_bytes_after_eval = max([full_bytes_after_eval] + [
                h.full.untyped_storage().nbytes() for _, st in units(model) for h in st.handles
                if h.full is not None])
    return {"evals": evals, "params": named_full(model, p.get("wrap", True)),
            "full_bytes_after_eval": full_bytes_after_eval}


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


def padding_rezeroed(ctx, p: dict) -> dict:
    """Write garbage into every shard's padding (as a careless optimizer could), then train on:
    the next gather must see zeros again, and no gradient may appear in the padding."""
    model, spec = build(p, ctx)
    opt = make_optimizer(model.parameters(), "sgd", 0.05)
    worst_after_forward, worst_after_step = 0.0, 0.0
    corrupted = 0
    for step in range(1, 4):
        with torch.no_grad():
            for _, state in units(model):
                for h in state.handles:
                    local = _local_padding(h, ctx.rank)
                    h.shard[local] = 7.0
                    corrupted += int(local.sum())
        x, y = local_batch(spec, p, step, ctx)
        loss = spec.loss(model(x), y)
        worst_after_forward = max(worst_after_forward, padding_max(model, ctx))
        loss.backward()
        opt.step()
        worst_after_step = max(worst_after_step, padding_max(model, ctx))
        opt.zero_grad()
    return {"corrupted": corrupted, "after_forward": worst_after_forward, "after_step": worst_after_step,
            "params": named_full(model, True)}
