"""Per-sample gradient norms and DP-SGD clipping (no noise) for models wrapped by ``fully_shard``.

    per_sample_grad_norms(model, loss_fn, inputs, targets, global_indices, group=None)
        -> norms of ALL samples of the global batch, in global sample order, the same on every rank
    clipped_mean_grads(model, loss_fn, inputs, targets, global_indices, max_norm, group=None)
        -> sets every trainable parameter's .grad (this rank's shard) to the clip-then-average
           gradient; a stock ``optimizer.step()`` then applies the exact DP-SGD update (sigma = 0)
    local_per_sample_grad_norms(model, loss_fn, inputs, targets) -> this rank's samples, local order

Usage (every rank, each with its own slice and the global indices of its samples):

    norms = clipped_mean_grads(model, F.cross_entropy, x, y, idx, max_norm=1.0, group=pg)
    optimizer.step()  # for DP-SGD add N(0, (sigma C / B)^2) to each rank's own shard of .grad first

Requirements: ``model(inputs)`` returns one tensor with samples along dim 0, samples do not
interact (no BatchNorm), and the loss is a mean of per-sample losses. Cost: two forward/backward
passes (norms, then the reweighted loss); the norm pass keeps each hooked module's input until
its backward, as autograd does, plus a T x T Gram matrix per sample for sequence inputs.

Convention: a "per-sample gradient" is the gradient of the per-sample loss l_i, where
``loss_fn(model(x), y)`` is the MEAN of l_i over the samples given (F.mse_loss, F.cross_entropy
over equal-length sequences). It is NOT the 1/B-scaled contribution of sample i to the batch
gradient. This is the DP-SGD convention: clip each grad(l_i) to max_norm, then average.

How the norms are computed (ghost norms, in the ordinary sharded forward/backward):
  forward hooks on every module that owns trainable parameters keep its (detached) inputs; a
  pre-hook on its output's grad_fn receives dL/d(output). Autograd runs a grad_fn's pre-hooks
  after every hook on the output tensor, so the unit's pre-backward hook has gathered the
  parameters again by then (they are only needed by the generic rule below). Rules:
    nn.Linear     2D input: |grad W_i|^2 = |a_i|^2 |g_i|^2;  sequences (B, T, d): the Gram trick
                  sum((A_i A_i^T) * (G_i G_i^T)), or G_i^T A_i materialized when T^2 is larger
    nn.Embedding  sum over position pairs with the same token of g_t . g_s (padding_idx excluded)
    any other     per-sample gradients by torch.func (vmap over samples of vjp of the module's own
                  ``forward`` with its parameters swapped in); needs a forward that treats samples
                  independently (no BatchNorm) and one tensor output.
  Parameters used by more than one module or call (tied weights) get materialized per-sample
  gradients that are summed before the norm.
Every rank sees the FULL parameters during forward and backward (they are gathered), so the norms
of its own samples are complete locally: parameter sharding needs no reduction of norms at all.
Only the data layout matters, and it is read from the global indices (all-gathered): identical
on every rank (replicated data) -> keep the local norms; different (split data, e.g.
DistributedSampler) -> all-gather the norms and place each at its global index. Summing norms
position by position across ranks (all-reduce) is wrong either way: with split data it adds
different samples' norms (mean inflated by >= sqrt(W)), with replicated data it adds W copies
(exactly sqrt(W)).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import vjp, vmap

from .module import original_class
from .state import units

__all__ = ["per_sample_grad_norms", "local_per_sample_grad_norms", "clipped_mean_grads", "gather_by_index"]


# ---------------------------------------------------------------------------- public entry points


def per_sample_grad_norms(
    model: nn.Module, loss_fn, inputs: Tensor, targets: Tensor, global_indices: Tensor, *, group=None
) -> Tensor:
    """1D float64 tensor of length B (the global batch): entry k is |grad l_k| for global sample k.

    Collective over `group` (all ranks call it). ``.grad`` of the parameters is left as it was.
    """
    layout = _Layout(global_indices, group, _device_of(model, inputs))  # before any work: bad indices fail fast
    return layout.place(local_per_sample_grad_norms(model, loss_fn, inputs, targets))


def clipped_mean_grads(
    model: nn.Module,
    loss_fn,
    inputs: Tensor,
    targets: Tensor,
    global_indices: Tensor,
    max_norm: float,
    *,
    group=None,
    eps: float = 1e-6,
) -> Tensor:
    """Set each trainable parameter's ``.grad`` to its part of (1/B) sum_k c_k grad l_k, where
    c_k = min(1, max_norm / (|grad l_k| + eps)) (Opacus' clip factor). Returns the norms (global order).

    Two forward/backward passes: one for the norms, one with dL/d(output) of sample i scaled by its
    weight. The weight of a sample held by m ranks is c_k * W / (B * m), so after fsdp_impl's
    gradient MEAN over the W ranks of `group` (the group the model was sharded over; under HSDP
    the group of all R x S ranks, e.g. WORLD, not the shard group: the mean runs over all of them)
    each sample counts c_k / B whatever the layout (m = W replicated, m = 1 split). Existing
    ``.grad`` is replaced.
    """
    layout = _Layout(global_indices, group, _device_of(model, inputs))
    norms = layout.place(local_per_sample_grad_norms(model, loss_fn, inputs, targets))
    clip = (max_norm / (norms + eps)).clamp(max=1.0)  # float64, global order
    weights = clip[layout.local] * layout.world_size / (layout.batch * layout.multiplicity[layout.local])
    for p in model.parameters():
        p.grad = None
    out = model(inputs)
    _scale_output_grad(out, weights * inputs.shape[0])  # loss_fn divides by the local count
    loss_fn(out, targets).backward()
    return norms


def local_per_sample_grad_norms(model: nn.Module, loss_fn, inputs: Tensor, targets: Tensor) -> Tensor:
    """|grad l_i| for this rank's samples, in local order (float64). No communication of its own
    (the forward/backward gathers and reduce-scatters as usual); ``.grad`` is restored afterwards."""
    owners = _trainable_owners(model)
    saved = {p: p.grad for p in model.parameters()}
    collector = _GhostNorms(owners, inputs.shape[0])
    try:
        for p in saved:
            p.grad = None
        with collector:
            out = model(inputs)
        _scale_output_grad(out, torch.full((inputs.shape[0],), float(inputs.shape[0]), dtype=torch.float64))
        loss_fn(out, targets).backward()
        return collector.result()
    finally:
        for p, g in saved.items():
            p.grad = g


def gather_by_index(local: Tensor, global_indices: Tensor, *, group=None) -> Tensor:
    """Per-sample values of this rank's samples -> values of the whole global batch, in global
    order, on every rank. Replicated indices: local values as they are; otherwise all-gathered.
    Collectives run on ``local.device`` (a CUDA tensor for NCCL)."""
    return _Layout(global_indices, group, local.device).place(local)


# --------------------------------------------------------------------------------- data layout


class _Layout:
    """Who holds which global sample: read from every rank's index list (one small all-gather)."""

    def __init__(self, global_indices: Tensor, group, device):
        self.local = torch.as_tensor(global_indices, dtype=torch.long).reshape(-1).cpu()
        self.group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.world_size = 1 if self.group is None else dist.get_world_size(self.group)
        self.device = device
        self.per_rank = self._all_gather_long(self.local)
        # checked on every rank's list, so that all ranks raise together (none is left in a collective)
        for r, indices in enumerate(self.per_rank):
            if len(set(indices.tolist())) != len(indices):
                raise ValueError(f"global_indices of rank {r} repeat a sample")
        held = torch.cat(self.per_rank)
        self.batch = int(held.max()) + 1 if len(held) else 0
        self.multiplicity = torch.bincount(held, minlength=self.batch).to(torch.float64)
        if (self.multiplicity == 0).any():
            missing = torch.nonzero(self.multiplicity == 0).flatten()[:5].tolist()
            raise ValueError(f"no rank holds global samples {missing}: indices must cover 0..B-1")
        self.replicated = all(torch.equal(r, self.local) for r in self.per_rank)

    def place(self, local_values: Tensor) -> Tensor:
        """Global-order values, the same on every rank (gathered unless the data is replicated)."""
        local_values = local_values.to(torch.float64)
        if local_values.shape[0] != len(self.local):
            raise ValueError(f"{local_values.shape[0]} values for {len(self.local)} local samples")
        out = torch.empty(self.batch, dtype=torch.float64)
        if self.replicated:  # every rank computed the same full set: nothing to exchange
            out[self.local] = local_values.cpu()
            return out
        values = self._all_gather(local_values)
        for idx, vals in reversed(list(zip(self.per_rank, values))):  # overlaps: the lowest rank wins
            out[idx] = vals
        return out

    # uneven lengths: gather the lengths, pad to the longest, gather, trim
    def _all_gather_long(self, t: Tensor) -> list[Tensor]:
        return [x.long() for x in self._all_gather(t.to(torch.float64))]  # exact below 2**53

    def _all_gather(self, t: Tensor) -> list[Tensor]:
        if self.world_size == 1:
            return [t.cpu()]
        n = torch.tensor([t.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        longest = max(int(s) for s in sizes)
        send = torch.zeros(longest, dtype=t.dtype, device=self.device)
        send[: t.numel()] = t.to(self.device)
        recv = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(recv, send, group=self.group)
        return [r[: int(s)].cpu() for r, s in zip(recv, sizes)]


def _device_of(model: nn.Module, inputs: Tensor) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else inputs.device


def _scale_output_grad(out: Tensor, per_sample: Tensor) -> None:
    """Multiply dL/d(out) of sample i by per_sample[i] (identity in forward)."""
    if not isinstance(out, Tensor) or not out.requires_grad:
        raise TypeError("the model must return one tensor that requires grad, samples along dim 0")
    scale = per_sample.to(out.device, out.dtype).reshape(-1, *([1] * (out.dim() - 1)))
    out.register_hook(lambda g: g * scale)


# ------------------------------------------------------------------------------ ghost norms


def _trainable_owners(model: nn.Module) -> dict[nn.Module, list[tuple[str, object]]]:
    """module -> [(attribute name, key identifying the parameter)] for every trainable parameter.

    Sharded parameters are keyed by their ShardedParam, shared by all owners of a tied parameter
    (during forward and backward the owners point at its unsharded parameter). Unsharded
    parameters are found in ``_parameters`` and keyed by identity."""
    owners: dict[nn.Module, list[tuple[str, object]]] = defaultdict(list)
    for _, state in units(model):
        for p in state.params.params:
            if p.requires_grad:
                for o in p.owners:
                    owners[o.module].append((o.name, id(p)))
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and p.requires_grad and not getattr(p, "_fsdp_managed", False):
                owners[m].append((name, id(p)))
    return dict(owners)


class _GhostNorms:
    """Context manager: while active, forward hooks record what the backward needs."""

    def __init__(self, owners: dict[nn.Module, list[tuple[str, object]]], n: int):
        self.owners, self.n = owners, n
        self.uses: dict[object, int] = defaultdict(int)  # parameter key -> forward uses
        self.sq = torch.zeros(n, dtype=torch.float64)  # untied parameters, summed norm^2
        self.shared: dict[object, Tensor] = {}  # tied key -> per-sample gradients (n, *shape)
        self._handles = []

    def __enter__(self):
        for m in self.owners:
            self._handles.append(m.register_forward_hook(self._forward_hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    def result(self) -> Tensor:
        sq = self.sq.clone()
        for g in self.shared.values():
            sq += g.reshape(self.n, -1).double().pow(2).sum(1).cpu()
        return sq.sqrt()

    def _forward_hook(self, module, args, kwargs, output):
        if not torch.is_grad_enabled() or not isinstance(output, Tensor) or output.grad_fn is None:
            return
        for _, key in self.owners[module]:
            self.uses[key] += 1
        acts = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        kw = {k: v.detach() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        slot = output.output_nr

        def prehook(grad_outputs):
            self._backward(module, acts, kw, grad_outputs[slot].detach())

        output.grad_fn.register_prehook(prehook)

    def _backward(self, module, acts, kw, g: Tensor) -> None:
        names = self.owners[module]
        tied = [self.uses[key] > 1 for _, key in names]
        if not any(tied) and not kw:
            kind = original_class(type(module))  # a unit's class is FSDP<class> (module.py)
            if kind is nn.Linear:
                self.sq += _linear_sq(module, acts[0], g).cpu()
                return
            if kind is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq:
                self.sq += _embedding_sq(module, acts[0], g).cpu()
                return
        grads = _per_sample_grads(module, [n for n, _ in names], acts, kw, g)
        for (name, key), is_tied in zip(names, tied):
            if is_tied:
                self.shared[key] = self.shared[key] + grads[name] if key in self.shared else grads[name]
            else:
                self.sq += grads[name].reshape(self.n, -1).double().pow(2).sum(1).cpu()


def _linear_sq(module: nn.Linear, a: Tensor, g: Tensor) -> Tensor:
    n = a.shape[0]
    a, g = a.reshape(n, -1, a.shape[-1]).double(), g.reshape(n, -1, g.shape[-1]).double()  # (n, T, d)
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    sq = torch.zeros(n, dtype=torch.float64, device=a.device)
    if module.weight.requires_grad:
        if t == 1:
            sq += a.pow(2).sum((1, 2)) * g.pow(2).sum((1, 2))
        elif 2 * t * t <= d_in * d_out:  # ghost: (T x T) Gram matrices
            sq += ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
        else:
            sq += torch.einsum("nto,nti->noi", g, a).pow(2).sum((1, 2))
    if module.bias is not None and module.bias.requires_grad:
        sq += g.sum(1).pow(2).sum(1)
    return sq


def _embedding_sq(module: nn.Embedding, tokens: Tensor, g: Tensor) -> Tensor:
    n = tokens.shape[0]
    tok, g = tokens.reshape(n, -1), g.reshape(n, -1, g.shape[-1]).double()  # (n, T), (n, T, d)
    if module.padding_idx is not None:
        g = g * (tok != module.padding_idx).unsqueeze(-1)
    same = (tok.unsqueeze(2) == tok.unsqueeze(1)).double()  # (n, T, T)
    return (same * (g @ g.transpose(1, 2))).sum((1, 2))


def _per_sample_grads(module: nn.Module, names: list[str], acts: tuple, kw: dict, g: Tensor) -> dict[str, Tensor]:
    """{name: (n, *shape)} by vmap over samples of the vjp of the module's forward (hooks bypassed)."""
    n = g.shape[0]
    params = {name: getattr(module, name).detach() for name in names}
    batched = [isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == n for a in acts]
    tensors = [a for a, b in zip(acts, batched) if b]

    def one(p: dict, sample: list, g_i: Tensor) -> dict:
        it = iter(sample)
        args = [next(it).unsqueeze(0) if b else a for a, b in zip(acts, batched)]

        def f(p):
            with _swapped(module, p):
                return module.forward(*args, **kw)

        _, pull = vjp(f, p)
        return pull(g_i.unsqueeze(0))[0]

    return vmap(one, in_dims=(None, 0, 0))(params, tensors, g)


@contextlib.contextmanager
def _swapped(module: nn.Module, values: dict[str, Tensor]):
    """Temporarily make ``module.<name>`` return values[name] (registered parameter or plain view)."""
    saved = {}
    for name, v in values.items():
        if name in module._parameters:
            saved[name] = ("p", module._parameters[name])
            module._parameters[name] = v
        else:
            saved[name] = ("d", module.__dict__.get(name))
            module.__dict__[name] = v
    try:
        yield
    finally:
        for name, (where, old) in saved.items():
            if where == "p":
                module._parameters[name] = old
            elif old is None:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = old
