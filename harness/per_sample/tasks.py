"""Per-sample gradient norms under FSDP, in both data modes.

DP-SGD clips each sample's gradient before averaging, so a sharded implementation must produce
the norm of every sample's gradient, in global sample order, whatever the data layout. Three
layers, as for training equivalence:

- ground truth: the plain model in float64, one process, ``torch.func.vmap`` of ``grad`` of the
  per-sample loss (``truth``); sanity-checked against a loop of single-sample backwards;
- tasks run inside a ``World`` on every rank: ``norms_task`` (fsdp_impl's norms plus two known-bad
  aggregations), ``clipped_update_task`` (one clip-then-average SGD step), and ``opacus_fsdp_task``;
- pure checks returning ``Verdict``s: ``per_sample_norms`` and ``clipped_update``.

Convention: norms are of grad l_i, the per-sample loss gradient (the DP-SGD convention), where the
batch loss ``spec.loss`` is the mean of l_i. Clip factor c_i = min(1, C / (|grad l_i| + 1e-6)).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from harness.core.policy import CLIPPED_UPDATE_RTOL, PER_SAMPLE_RTOL
from harness.core.verdict import FAIL, PASS, Verdict
from harness.train.data import global_batch, local_slice
from harness.train.models import ModelSpec, get_model_spec

CLIP_EPS = 1e-6  # Opacus' epsilon in C / (norm + eps); fsdp_impl uses the same
NORM_VARIANTS = ("fsdp_impl", "allreduce", "allreduce_partial")


# ------------------------------------------------------------------------------- ground truth


def per_sample_losses(spec: ModelSpec, outputs: Tensor, targets: Tensor) -> Tensor:
    """l_i = spec.loss on sample i alone; spec.loss of the batch is their mean."""
    return vmap(lambda o, t: spec.loss(o.unsqueeze(0), t.unsqueeze(0)))(outputs, targets)


def truth_model(model: str, seed: int) -> nn.Module:
    """The model every rank builds (same seed, same init), as a float64 copy."""
    torch.manual_seed(seed)
    return get_model_spec(model).build().double()


def truth_batch(model: str, batch: int, step: int, seed: int) -> tuple[Tensor, Tensor]:
    x, y = global_batch(get_model_spec(model), batch, step, seed)
    return (x.double() if x.is_floating_point() else x), (y.double() if y.is_floating_point() else y)


def truth_grads(model: nn.Module, spec: ModelSpec, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """{name: (B, *shape)} per-sample gradients of l_i (tied parameters once, summed over uses)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_one(p, xi, yi):
        return spec.loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def norms_of(grads: dict[str, Tensor]) -> Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def loop_norms(model: nn.Module, spec: ModelSpec, x: Tensor, y: Tensor) -> Tensor:
    """The same norms by B ordinary single-sample backwards (a check of the vmap truth)."""
    out = []
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        spec.loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        out.append(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    model.zero_grad(set_to_none=True)
    return torch.stack(out).sqrt()


def clipped_mean_update(grads: dict[str, Tensor], norms: Tensor, max_norm: float, lr: float) -> dict[str, Tensor]:
    """The exact DP-SGD step without noise: -lr * (1/B) sum_i c_i grad l_i."""
    clip = (max_norm / (norms + CLIP_EPS)).clamp(max=1.0)
    return {k: -lr * (clip.reshape(-1, *[1] * (g.dim() - 1)) * g).mean(0) for k, g in grads.items()}


@dataclass(frozen=True)
class Truth:
    norms: tuple[float, ...]  # global sample order
    loop_norms: tuple[float, ...]
    grads: dict  # name -> (B, *shape) float64

    def update(self, max_norm: float, lr: float) -> dict[str, Tensor]:
        return clipped_mean_update(self.grads, torch.tensor(self.norms, dtype=torch.float64), max_norm, lr)


@functools.lru_cache(maxsize=16)
def truth(model: str, seed: int, batch: int, step: int = 1) -> Truth:
    spec, m = get_model_spec(model), truth_model(model, seed)
    x, y = truth_batch(model, batch, step, seed)
    grads = truth_grads(m, spec, x, y)
    return Truth(tuple(norms_of(grads).tolist()), tuple(loop_norms(m, spec, x, y).tolist()), grads)


# ------------------------------------------------------------------------ tasks (inside worlds)


def _wrapped_fsdp_impl(p: dict, ctx) -> tuple[nn.Module, ModelSpec, Tensor, Tensor, Tensor]:
    """Seeded model sharded by fsdp_impl (units, then root) and this rank's slice of the batch."""
    from fsdp_impl import fully_shard

    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    model = spec.build().to(ctx.device)
    for unit in spec.units(model):
        fully_shard(unit, process_group=ctx.group)
    fully_shard(model, process_group=ctx.group)
    x, y = global_batch(spec, p["batch"], p.get("step", 1), p["seed"])
    if p.get("indices") is not None:  # any layout: uneven, partly overlapping (payload: one list per rank)
        idx = torch.tensor(p["indices"][ctx.rank], dtype=torch.long)
        x, y = x[idx], y[idx]
    else:
        x, y, idx = local_slice(x, y, ctx.rank, ctx.world_size, p["mode"])
    return model, spec, x.to(ctx.device), y.to(ctx.device), idx


def _position_wise(local: Tensor, idx: Tensor, ctx) -> list[float]:
    """The known bug: sum squared norms position by position over ranks, then read entry j as the
    norm of this rank's j-th sample. Returned in global order (rank r's j-th sample gets entry j)."""
    sq = local.double().pow(2).to(ctx.device)
    dist.all_reduce(sq, group=ctx.group)
    every = [None] * ctx.world_size
    dist.all_gather_object(every, idx.tolist(), group=ctx.group)
    out = [math.nan] * (max(max(i) for i in every) + 1)
    for indices in every:
        for j, k in enumerate(indices):
            out[k] = float(sq[j].sqrt())
    return out


def _partial_shard_norms(p: dict, ctx, x: Tensor, y: Tensor) -> Tensor:
    """Per-sample squared norms over this rank's 1/W of the flattened parameters (how a shard-
    local ghost norm would see them): a plain copy of the same seeded model, torch.func grads."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    plain = spec.build().to(ctx.device)
    flat = torch.cat([g.flatten(1) for g in truth_grads(plain, spec, x, y).values()], 1)  # (n, P)
    per = math.ceil(flat.shape[1] / ctx.world_size)
    return flat[:, ctx.rank * per : (ctx.rank + 1) * per].double().pow(2).sum(1)


def norms_task(ctx, p: dict) -> dict:
    """payload: model, seed, batch, mode (or indices: one list per rank), variants. Every rank
    returns its global-order norms."""
    from fsdp_impl.per_sample import local_per_sample_grad_norms, per_sample_grad_norms

    model, spec, x, y, idx = _wrapped_fsdp_impl(p, ctx)
    out = {}
    for v in p.get("variants", NORM_VARIANTS):
        if v == "fsdp_impl":
            out[v] = per_sample_grad_norms(model, spec.loss, x, y, idx, group=ctx.group).tolist()
        elif v == "allreduce":
            out[v] = _position_wise(local_per_sample_grad_norms(model, spec.loss, x, y), idx, ctx)
        elif v == "allreduce_partial":
            out[v] = _position_wise(_partial_shard_norms(p, ctx, x, y).sqrt(), idx, ctx)
        else:
            raise ValueError(f"unknown norm variant {v!r}; valid: {', '.join(NORM_VARIANTS)}")
    return {"rank": ctx.rank, "indices": idx.tolist(), "norms": out}


def clipped_update_task(ctx, p: dict) -> dict:
    """payload: model, seed, batch, mode, max_norm, lr. One SGD step on fsdp_impl's clipped-mean
    gradients; rank 0 returns the full parameter update {name: flat list}, every rank its norms."""
    from fsdp_impl import full_state_dict
    from fsdp_impl.per_sample import clipped_mean_grads

    model, spec, x, y, idx = _wrapped_fsdp_impl(p, ctx)
    before = full_state_dict(model)
    opt = torch.optim.SGD(model.parameters(), lr=p["lr"])
    norms = clipped_mean_grads(model, spec.loss, x, y, idx, p["max_norm"], group=ctx.group, eps=CLIP_EPS)
    opt.step()
    after = full_state_dict(model)
    update = {k: (after[k].double() - before[k].double()).flatten().tolist() for k in before}
    return {"rank": ctx.rank, "norms": norms.tolist(), "update": update if ctx.rank == 0 else None}


# ------------------------------------------------------------------------------------ checks


def check_per_sample_norms(
    scenario: str, per_rank: list[list[float]], truth_norms, *, bound: float = PER_SAMPLE_RTOL
) -> Verdict:
    """Every rank's norms vs the truth, sample by sample: max relative error; ranks must agree."""
    t = torch.tensor(list(truth_norms), dtype=torch.float64)
    if not per_rank:
        return Verdict(
            "per_sample_norms", scenario, FAIL, None, bound, message="could not be checked: no norms were produced"
        )
    worst, at = -1.0, {}
    for r, values in enumerate(per_rank):
        v = torch.tensor(values, dtype=torch.float64)
        if v.shape != t.shape:
            return Verdict(
                "per_sample_norms",
                scenario,
                FAIL,
                math.inf,
                bound,
                rank=r,
                message=f"rank {r} gave {v.numel()} norms for a global batch of {t.numel()}",
            )
        rel = ((v - t).abs() / t).nan_to_num(math.inf)
        k = int(rel.argmax())
        if float(rel[k]) > worst:
            worst, at = float(rel[k]), {"sample": k, "rank": r}
    agree = all(torch.equal(torch.tensor(v), torch.tensor(per_rank[0])) for v in per_rank)
    mean_v, mean_t = sum(per_rank[0]) / len(per_rank[0]), float(t.mean())
    ratio = mean_v / mean_t
    passed = worst < bound and agree
    msg = (
        f"max relative error {worst:.3g} vs truth (bound {bound:g}); mean norm {mean_v:.4g} vs truth "
        f"{mean_t:.4g} (ratio {ratio:.3f}); ranks {'agree' if agree else 'DISAGREE'}"
    )
    return Verdict(
        "per_sample_norms", scenario, PASS if passed else FAIL, worst, bound, message=msg, **({} if passed else at)
    )


def check_clipped_update(
    scenario: str, update: dict[str, list], truth_update: dict[str, Tensor], *, bound: float = CLIPPED_UPDATE_RTOL
) -> Verdict:
    """max |update - truth| / max |truth| over all parameters; the message gives the norm ratio."""
    missing = sorted(set(truth_update) - set(update))
    if missing:
        return Verdict(
            "clipped_update",
            scenario,
            FAIL,
            math.inf,
            bound,
            param=missing[0],
            message=f"no update for {len(missing)} parameters, e.g. {missing[0]}",
        )
    scale = max(float(t.abs().max()) for t in truth_update.values())
    worst, where, num, den = -1.0, "", 0.0, 0.0
    for name, t in truth_update.items():
        u = torch.tensor(update[name], dtype=torch.float64).reshape(t.shape)
        err = float((u - t).abs().max()) / scale
        num, den = num + float(u.pow(2).sum()), den + float(t.pow(2).sum())
        if err > worst:
            worst, where = err, name
    ratio = math.sqrt(num / den) if den else math.nan
    passed = worst < bound
    msg = (
        f"max |update - exact clipped-mean update| = {worst:.3g} of its largest entry (bound {bound:g}); "
        f"|update| / |exact| = {ratio:.4f}"
    )
    return Verdict(
        "clipped_update", scenario, PASS if passed else FAIL, worst, bound, message=msg, param="" if passed else where
    )


# ------------------------------------------------------------------------ Opacus (optional)


def opacus_unavailable() -> str | None:
    """None when Opacus' ghost_fsdp and ghost_tp paths import; otherwise why not, in one line."""
    try:
        import opacus
        from opacus.grad_sample import GradSampleModuleFastGradientClippingTP  # noqa: F401
        from opacus.utils.fsdp_utils import FSDP2Wrapper  # noqa: F401
    except Exception as exc:  # ImportError, or a version that breaks against this torch
        return f"opacus is not usable here: {type(exc).__name__}: {exc}"
    if not hasattr(opacus, "PrivacyEngine"):
        return "opacus imports but has no PrivacyEngine"
    return None


class PerSampleLoss(nn.Module):
    """``spec.loss`` as an Opacus criterion: ``reduction`` 'none' gives l_i, 'mean' / 'sum' reduce them."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec, self.reduction = spec, "mean"

    def forward(self, outputs: Tensor, targets: Tensor) -> Tensor:
        losses = per_sample_losses(self.spec, outputs, targets)
        return {"none": losses, "mean": losses.mean(), "sum": losses.sum()}[self.reduction]


def _gather_global(local: list[float], idx: list[int], ctx) -> tuple[list[float], list[float]]:
    """(norms placed at their global indices, the position-wise all-reduce of the same norms)."""
    every = [None] * ctx.world_size
    dist.all_gather_object(every, (idx, local), group=ctx.group)
    placed = [math.nan] * (max(max(i) for i, _ in every) + 1)
    for indices, values in every:
        for k, v in zip(indices, values):
            placed[k] = v
    return placed, _position_wise(torch.tensor(local, dtype=torch.float64), torch.tensor(idx), ctx)


def opacus_fsdp_task(ctx, p: dict) -> dict:
    """Opacus' documented ghost-clipping FSDP recipe: FSDP2Wrapper (torch fully_shard over the
    world), make_private(grad_sample_mode="ghost_fsdp", noise 0, no Poisson sampling) with the data
    loader each mode implies (replicated: the whole batch; split: DistributedSampler, no shuffle),
    one step of SGD(lr). Returns Opacus' own (local) norms, them gathered by index, them all-reduced
    position-wise, the expected batch size it derived, and the parameter update (rank 0)."""
    import warnings

    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    root = FSDP2Wrapper(spec.build())
    x_all, y_all = global_batch(spec, p["batch"], p.get("step", 1), p["seed"])
    data = TensorDataset(x_all, y_all)
    if p["mode"] == "split":
        sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
        loader, idx = DataLoader(data, batch_size=p["batch"] // ctx.world_size, sampler=sampler), list(sampler)
    else:
        loader, idx = DataLoader(data, batch_size=p["batch"], shuffle=False), list(range(p["batch"]))
    before = _full_dtensor_params(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, criterion, loader = PrivacyEngine().make_private(
            module=root,
            optimizer=torch.optim.SGD(root.parameters(), lr=p["lr"]),
            criterion=PerSampleLoss(spec),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=p["max_norm"],
            grad_sample_mode="ghost_fsdp",
            poisson_sampling=False,
        )
        x, y = next(iter(loader))
        criterion(model(x), y).backward()
        local = model.per_sample_gradient_norms.detach().double().flatten().tolist()
        opt.step()
    after = _full_dtensor_params(root)
    placed, allreduced = _gather_global(local, idx, ctx)
    return {
        "rank": ctx.rank,
        "indices": idx,
        "local_norms": local,
        "gathered": placed,
        "allreduce": allreduced,
        "expected_batch_size": float(opt.expected_batch_size),
        "module": type(model).__name__,
        "update": {k: (after[k] - before[k]).flatten().tolist() for k in before} if ctx.rank == 0 else None,
    }


def _full_dtensor_params(module: nn.Module) -> dict[str, Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().double().clone()
        for k, v in module.named_parameters()
    }
