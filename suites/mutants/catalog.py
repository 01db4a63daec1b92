"""A catalogue of injectable faults ("mutants") over fsdp_impl, each a test-only adapter.

A verification harness is only as good as the bugs it catches. Every mutant below is the
``fsdp_impl`` adapter with ONE realistic fault injected into the objects of the model it wraps,
and nowhere else: worker processes are reused for many scenarios, so a mutant never patches a
class or a module. Faults are injected in three ways:

- ``_rebind(handle, "_post_backward", reduce_scatter_mean=f)``: the product's own method, bound
  to this handle only, with one module-level name it calls replaced (a copy of the function with
  its globals changed; the product code runs unchanged around the fault);
- instance attributes on a ``FlatParamHandle`` / ``UnitState`` (``h.zero_padding_``,
  ``state.reshard_after_forward``, ``h.layout``), which shadow the class's for that object only;
- a different ``wrap`` / ``make_optimizer`` / ``after_backward`` in the adapter.

``CATALOGUE`` lists each mutant with the check expected to catch it and the matrix that exposes
it; ``CONTROLS`` are unmutated adapters run beside them (a mutant's failure must come from its
fault, not from the way it is injected). ``suites/mutants/score.py`` runs them all in one matrix.

A mutant that escapes is a gap in the harness: the answer is a sharper check or scenario, never a
weaker mutant. ``grad_norm_matches``, ``peak_params_bound`` and the ``mlp_frozen`` model came from
mutants that once escaped.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.adapters.base import AdapterError
from harness.adapters.fsdp_impl import FsdpImplAdapter

MODULE = __name__


# ------------------------------------------------------------------------------ injection helpers

def _units(wrapped: nn.Module):
    """(prefix, UnitState) of every fully_shard unit under `wrapped`."""
    from fsdp_impl.api import units

    return list(units(wrapped))


def _handles(wrapped: nn.Module):
    """(unit prefix, FlatParamHandle) for every handle of every unit."""
    return [(prefix, h) for prefix, state in _units(wrapped) for h in state.handles]


def _names_used(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code of functions nested in it) refers to."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names_used(const)
    return out


def _with_globals(fn: types.FunctionType, **names) -> types.FunctionType:
    """A copy of `fn` that sees `names` instead of the module-level objects of the same name."""
    missing = [n for n in names if n not in fn.__globals__ or n not in _names_used(fn.__code__)]
    if missing:  # the product was refactored: say which hook this mutant can no longer reach
        raise AdapterError(f"mutant: {fn.__module__}.{fn.__qualname__} no longer refers to {missing}; "
                           f"update suites/mutants/catalog.py")
    g = dict(fn.__globals__)
    g.update(names)
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _rebind(obj: object, method: str, **names) -> None:
    """Set ``obj.<method>`` (this object only) to the class's method with `names` replaced."""
    fn = getattr(type(obj), method, None)
    if not isinstance(fn, types.FunctionType):
        raise AdapterError(f"mutant: {type(obj).__name__}.{method} is gone; update suites/mutants/catalog.py")
    setattr(obj, method, types.MethodType(_with_globals(fn, **names), obj))


def _collectives():
    from fsdp_impl import collectives

    return collectives


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class MutantAdapter(FsdpImplAdapter):
    """fsdp_impl with a fault injected by ``mutate`` into the wrapped model's own objects."""

    name = "mutant"

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        wrapped = super().wrap(model, units, group=group, device=device)
        self.mutate(wrapped)
        return wrapped

    def mutate(self, wrapped: nn.Module) -> None:
        """Inject the fault into `wrapped`'s own objects (mutants that fault elsewhere leave it)."""


# ------------------------------------------------------------------------------- gradient scale

class GradSummed(MutantAdapter):
    """Gradients summed over ranks, not averaged (the division by W is missing)."""

    name = "mutant:grad_summed"

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean

        def reduce_scatter_sum(full_grad, group, reduce_dtype):
            return mean(full_grad, group, reduce_dtype).mul_(dist.get_world_size(group))

        for _, h in _handles(wrapped):
            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_scatter_sum)


class AveragedTwice(MutantAdapter):
    """Gradients divided by W twice (e.g. the loss pre-divided by W and the reduction averaging too)."""

    name = "mutant:averaged_twice"

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean

        def reduce_scatter_mean_twice(full_grad, group, reduce_dtype):
            return mean(full_grad, group, reduce_dtype).div_(dist.get_world_size(group))

        for _, h in _handles(wrapped):
            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_scatter_mean_twice)


class LowPrecisionReduce(MutantAdapter):
    """Gradients reduced in bf16 although the policy says fp32 params / fp64 reduce: the gradient is
    cast to bf16 before the exchange (half the bytes) and summed in bf16."""

    name = "mutant:bf16_reduce"

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean

        def reduce_scatter_bf16(full_grad, group, reduce_dtype):
            return mean(full_grad.to(torch.bfloat16), group, torch.bfloat16)

        for _, h in _handles(wrapped):
            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_scatter_bf16)


class TiedReducedTwice(MutantAdapter):
    """A tied parameter's gradient counted once per owner (embedding and head each reduce the
    slot's accumulated gradient), so it is doubled."""

    name = "mutant:tied_reduced_twice"

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean
        for _, h in _handles(wrapped):
            tied = [(slot, len(owners)) for slot, owners in zip(h.layout.slots, h.owners) if len(owners) > 1]
            if not tied:
                continue

            def reduce_per_owner(full_grad, group, reduce_dtype, tied=tied):
                g = full_grad.clone()
                for slot, n_owners in tied:
                    g[slot.offset:slot.end] *= n_owners
                return mean(g, group, reduce_dtype)

            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_per_owner)


class GradsNotCleared(MutantAdapter):
    """The unsharded gradient is never cleared: autograd adds each step's gradient to the previous
    ones in the full buffer, so step k reduces the sum of steps 1..k (``optimizer.zero_grad``
    clears only the shard's .grad, which hides it at world size 1)."""

    name = "mutant:grads_not_cleared"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            product = h._post_backward  # bound before the first forward registers it as the hook

            def post_backward(full, product=product):
                kept = full.grad.detach().clone()
                product(full)
                full.grad = kept

            h._post_backward = post_backward


class FrozenUpdated(MutantAdapter):
    """Frozen parameters get gradients and are updated: the handle of the requires_grad=False
    group is treated as trainable (its gathered buffer requires grad, its gradient is reduced
    into the shard's .grad, and the optimizer, which lists every shard, steps it)."""

    name = "mutant:frozen_updated"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            if not h.requires_grad:
                h.requires_grad = True


# --------------------------------------------------------------------------- layout and padding

class _FloorOffsetLayout:
    """Mixin over a FlatLayout: each rank's shard starts at rank x floor(N / W) instead of
    rank x ceil(N / W) (N = elements used), so a rank past the first copies the wrong slice."""

    def rank_range(self, rank: int) -> tuple[int, int]:
        start = rank * (self.used_numel // self.world_size)
        return start, start + self.shard_numel


class WrongShardOffset(MutantAdapter):
    """Shards filled at a wrong offset (floor instead of ceil of N / W): rank r >= 1 holds the flat
    parameter shifted by r x (ceil - floor) elements, so the gathered parameters are misplaced."""

    name = "mutant:wrong_shard_offset"

    def wrap(self, model, units, *, group, device):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
        wrapped = FsdpImplAdapter.wrap(self, model, units, group=group, device=device)
        for prefix, h in _handles(wrapped):
            layout = h.layout
            cls = type(f"FloorOffset{type(layout).__name__}", (_FloorOffsetLayout, type(layout)), {})
            h.layout = cls(layout.slots, layout.world_size)
            with torch.no_grad():
                h.shard.zero_()
            for slot in h.layout.slots:
                h.load_full(slot, values[_join(prefix, slot.fqn)])
        return wrapped


class PaddingNotZeroed(MutantAdapter):
    """Padding never re-zeroed (not in the reduced gradient, not before a gather) while the reduce
    input's padding holds stale memory (a buffer allocated with torch.empty, modelled as 0.5):
    the optimizer writes values into the padding, and they leak into everything that reads the
    flat shards (gradient norm, clipping, non-elementwise optimizers)."""

    name = "mutant:padding_not_zeroed"
    JUNK = 0.5

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean
        for _, h in _handles(wrapped):
            layout = h.layout
            pad = [(a + layout.rank_range(r)[0], b + layout.rank_range(r)[0])
                   for r in range(layout.world_size) for a, b in layout.padding_mask_ranges(r)]

            def reduce_from_dirty_buffer(full_grad, group, reduce_dtype, pad=pad):
                buf = full_grad.clone()
                for a, b in pad:
                    buf[a:b] = self.JUNK
                return mean(buf, group, reduce_dtype)

            h.zero_padding_ = lambda flat_shard: None
            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_from_dirty_buffer)


class PaddingInView(MutantAdapter):
    """Views taken at packed offsets (the sum of the previous parameters' sizes) while the flat
    buffer is laid out with aligned offsets: a parameter after an alignment gap starts inside the
    zero padding, which leaks into its unpadded view."""

    name = "mutant:padding_in_view"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):

            def set_packed_views(full, h=h):
                offset = 0
                for slot, owners in zip(h.layout.slots, h.owners):
                    view = full[offset:offset + slot.numel].view(slot.shape)
                    for o in owners:
                        setattr(o.module, o.name, view)
                    offset += slot.numel

            h._set_views = set_packed_views


# ---------------------------------------------------------------------------- units and ranks

class NestedDuplication(MutantAdapter):
    """A parameter in two units: the root's fully_shard does not see that the blocks' parameters
    were already claimed by their own units and shards them again (every parameter twice in memory
    and gathered twice per pass; training follows the inner copy, so the numbers look right)."""

    name = "mutant:nested_duplication"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import fully_shard

        model.to(device)
        owned = [(sub, name, p) for sub in model.modules() for name, p in sub._parameters.items() if p is not None]
        for unit in units:
            fully_shard(unit, process_group=group)
        for sub, name, p in owned:
            if name not in sub._parameters:  # taken by a unit: make it visible to the root again
                p._fsdp_claimed = False
                sub._parameters[name] = p
        return fully_shard(model, process_group=group)


class StaleShard(MutantAdapter):
    """The last rank all-gathers a stale copy of its shard: it caches the shard it sends (as a
    param-dtype cast cache would) and never invalidates it after optimizer.step()."""

    name = "mutant:stale_shard"

    def mutate(self, wrapped):
        gather = _collectives().all_gather_flat
        for _, h in _handles(wrapped):
            if h.rank != h.world_size - 1 or h.world_size == 1:
                continue
            cache: dict[str, Tensor] = {}

            def gather_cached(out, shard, group, cache=cache):
                if "shard" not in cache:
                    cache["shard"] = shard.detach().clone()
                return gather(out, cache["shard"], group)

            _rebind(h, "_fill_full", all_gather_flat=gather_cached)


# ----------------------------------------------------------------------------- memory-only

class ReshardSkipped(MutantAdapter):
    """No reshard after forward: every unit keeps its full parameters from its forward until its
    backward (the numbers are unchanged, peak memory holds all units unsharded at once)."""

    name = "mutant:reshard_skipped"

    def mutate(self, wrapped):
        for _, state in _units(wrapped):
            state.reshard_after_forward = False


class OptimizerStateUnsharded(MutantAdapter):
    """Optimizer state kept for the whole flat parameter on every rank (as an optimizer built over
    the unsharded parameters): each rank's exp_avg / exp_avg_sq / momentum buffer is a full padded
    buffer of which it updates its own slice, so the numbers are unchanged and the state is W x."""

    name = "mutant:optimizer_state_unsharded"

    def make_optimizer(self, wrapped, *, name, lr):
        opt = super().make_optimizer(wrapped, name=name, lr=lr)
        keys = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}[name]
        for _, h in _handles(wrapped):
            if not h.requires_grad:
                continue
            lo = h.layout.rank_range(h.rank)[0]
            state = {k: torch.zeros(h.layout.padded_numel, dtype=h.dtype, device=h.device)[lo:lo + h.layout.shard_numel]
                     for k in keys}
            if name == "adamw":
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            opt.state[h.shard] = state
        return opt


# ------------------------------------------------------------------------------------ meta init

class MetaInit(FsdpImplAdapter):
    """CONTROL, not a mutant: the model rebuilt on the meta device, sharded, then materialized by
    fsdp_impl.materialize_meta with the seed the harness used, so it must match eager init bitwise."""

    name = "control:meta_init"

    def wrap(self, model, units, *, group, device):
        from fsdp_impl import fully_shard, materialize_meta

        seed, rng = torch.initial_seed(), torch.get_rng_state()  # harness: manual_seed(seed); build()
        fresh: dict[int, nn.Parameter] = {}
        for m in model.modules():  # every parameter to meta, ties kept
            for n, p in list(m._parameters.items()):
                if p is not None:
                    if id(p) not in fresh:
                        fresh[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                    m._parameters[n] = fresh[id(p)]
        for unit in units:
            fully_shard(unit, process_group=group)
        fully_shard(model, process_group=group)
        torch.manual_seed(seed)
        self.materialize(model, materialize_meta, device)
        torch.set_rng_state(rng)
        return model

    def materialize(self, model, materialize_meta, device):
        materialize_meta(model, device)


class MetaInitRngOrder(MetaInit):
    """Meta init replaying modules in a different order than eager construction (last module
    first): every parameter draws other random numbers than the eager model's."""

    name = "mutant:meta_init_rng_order"

    def materialize(self, model, materialize_meta, device):
        eager_order = list(type(model).named_modules(model))
        model.named_modules = lambda *a, **k: iter(reversed(eager_order))
        try:
            materialize_meta(model, device)
        finally:
            del model.named_modules


# --------------------------------------------------------------------------- per-sample norms

def per_sample_norms_allreduced():
    """fsdp_impl.per_sample.per_sample_grad_norms whose data layout, before placing the norms at
    their global indices, all-reduces the squared norms position by position over the ranks (as if
    each rank held a partial norm over its parameter shard): with split data it adds different
    samples' norms, with replicated data W copies of the same."""
    from fsdp_impl import per_sample

    class AllReducedLayout(per_sample._Layout):
        def place(self, local_values: Tensor) -> Tensor:
            sq = local_values.double().pow(2).to(self.device)
            dist.all_reduce(sq, group=self.group)
            return super().place(sq.sqrt())

    return _with_globals(per_sample.per_sample_grad_norms, _Layout=AllReducedLayout)


PER_SAMPLE_VARIANTS = {"control": None, "mutant": per_sample_norms_allreduced}


def per_sample_task(ctx, p: dict) -> dict:
    """World task: the seeded model sharded by fsdp_impl, this rank's slice of batch `step`, the
    per-sample norms of the global batch by the product ("control") and by the mutant."""
    from fsdp_impl.per_sample import per_sample_grad_norms
    from harness.train.data import global_batch, local_slice
    from harness.train.models import get_model_spec

    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    model = spec.build().to(ctx.device)
    model = FsdpImplAdapter().wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    x, y = global_batch(spec, p["batch"], p["step"], p["seed"])
    x, y, idx = local_slice(x, y, ctx.rank, ctx.world_size, p["mode"])
    out = {}
    for variant, make in PER_SAMPLE_VARIANTS.items():
        fn = per_sample_grad_norms if make is None else make()
        out[variant] = fn(model, spec.loss, x.to(ctx.device), y.to(ctx.device), idx, group=ctx.group).tolist()
    return {"rank": ctx.rank, "norms": out}


def frozen_probe_task(ctx, p: dict) -> dict:
    """World task: mlp_frozen (the MLP with layers.0 frozen) trained `steps` steps on replicated data
    by adapter `impl`; returns how far each frozen parameter moved (max |delta|)."""
    from harness.adapters import load_adapter
    from harness.train.data import global_batch, local_slice
    from harness.train.models import get_model_spec

    spec, adapter = get_model_spec("mlp_frozen"), load_adapter(p["impl"])
    torch.manual_seed(p["seed"])
    model = spec.build()
    assert not model.layers[0].weight.requires_grad, "mlp_frozen no longer freezes layers.0"
    wrapped = adapter.wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    opt = adapter.make_optimizer(wrapped, name=p["optimizer"], lr=p["lr"])
    before = adapter.full_params(wrapped)
    for step in range(1, p["steps"] + 1):
        x, y = global_batch(spec, p["batch"], step, p["seed"])
        x, y, _ = local_slice(x, y, ctx.rank, ctx.world_size, "replicated")
        spec.loss(wrapped(x.to(ctx.device)), y.to(ctx.device)).backward()
        adapter.after_backward(wrapped, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = adapter.full_params(wrapped)
    return {n: float((after[n] - before[n]).abs().max()) for n in ("layers.0.weight", "layers.0.bias")}


# ------------------------------------------------------------------------- the catalogue

@dataclass(frozen=True)
class Mutant:
    name: str
    spec: str  # adapter "package.module:object", or the world task for per-sample mutants
    expected: str  # the harness check that must catch it
    what: str  # the bug it models
    models: tuple[str, ...] = ("mlp",)
    data_modes: tuple[str, ...] = ("replicated", "split")
    optimizers: tuple[str, ...] = ("adamw", "sgd")
    world_sizes: tuple[int, ...] = (1, 2)
    steps: int = 3
    # first step at which a numeric check must see it, as (earliest, latest): the fault cannot act
    # before `earliest`; `latest` is the step by which the fault has changed an update directly
    at_steps: tuple[int, int] | None = (1, 1)
    kind: str = "numeric"  # "numeric" | "memory" | "per_sample"
    slow: bool = False  # behind @pytest.mark.slow (none is: the whole catalogue runs in ~1 minute)


def _spec(name: str) -> str:
    return f"{MODULE}:{name}"


# the names adapters are loaded by ("suites.mutants.catalog:grad_summed"): readable scenario ids
grad_summed, averaged_twice, bf16_reduce = GradSummed, AveragedTwice, LowPrecisionReduce
tied_reduced_twice, grads_not_cleared, frozen_updated = TiedReducedTwice, GradsNotCleared, FrozenUpdated
wrong_shard_offset, padding_not_zeroed, padding_in_view = WrongShardOffset, PaddingNotZeroed, PaddingInView
nested_duplication, stale_shard, reshard_skipped = NestedDuplication, StaleShard, ReshardSkipped
optimizer_state_unsharded, meta_init, meta_init_rng_order = OptimizerStateUnsharded, MetaInit, MetaInitRngOrder



CATALOGUE: tuple[Mutant, ...] = (
    Mutant("grad_summed", _spec("grad_summed"), "cross_ws_replicated",
           "gradients summed over ranks, not averaged (division by W missing)", world_sizes=(1, 2, 4)),
    Mutant("averaged_twice", _spec("averaged_twice"), "cross_ws_replicated",
           "gradients divided by W twice"),
    Mutant("wrong_shard_offset", _spec("wrong_shard_offset"), "cross_ws_replicated",
           "rank r's shard starts at r x floor(N/W) instead of r x ceil(N/W): misplaced parameters",
           world_sizes=(1, 2, 4)),
    Mutant("padding_not_zeroed", _spec("padding_not_zeroed"), "grad_norm_matches",
           "padding never re-zeroed and fed stale memory by the reduce buffer: the optimizer writes "
           "values into it, which leak into the gradient norm"),
    Mutant("padding_in_view", _spec("padding_in_view"), "ws1_exact",
           "views at packed offsets over an aligned layout: alignment padding leaks into the "
           "unpadded view of the next parameter"),
    Mutant("nested_duplication", _spec("nested_duplication"), "memory_sharding",
           "a parameter in two units: the root shards the blocks' parameters again",
           at_steps=None, kind="memory"),
    # tinylm: mlp's 3 units are too few for any peak bound that allows 2 units unsharded to see it
    Mutant("reshard_skipped", _spec("reshard_skipped"), "peak_params_bound",
           "no reshard after forward: every unit stays unsharded until its backward (memory only)",
           models=("tinylm",), data_modes=("replicated",), world_sizes=(1, 2, 4), at_steps=None,
           kind="memory"),
    Mutant("optimizer_state_unsharded", _spec("optimizer_state_unsharded"), "memory_sharding",
           "optimizer state kept for the whole flat parameter on every rank (memory only)",
           data_modes=("replicated",), at_steps=None, kind="memory"),  # memory does not depend on the mode
    Mutant("meta_init_rng_order", _spec("meta_init_rng_order"), "ws1_exact",
           "meta-device init replays reset_parameters in another order than eager construction"),
    Mutant("per_sample_norms_allreduced", f"{MODULE}:per_sample_task", "per_sample_norms",
           "per-sample gradient norms all-reduced position by position instead of gathered by index",
           world_sizes=(2, 4), optimizers=(), at_steps=None, kind="per_sample"),
    Mutant("grads_not_cleared", _spec("grads_not_cleared"), "cross_ws_replicated",
           "the unsharded gradient buffer is never cleared: step k reduces the sum of steps 1..k",
           at_steps=(2, 2)),
    Mutant("stale_shard", _spec("stale_shard"), "cross_ws_replicated",
           "the last rank all-gathers a cached shard from before the optimizer step",
           world_sizes=(1, 2, 4), at_steps=(2, 2)),
    Mutant("tied_reduced_twice", _spec("tied_reduced_twice"), "cross_ws_replicated",
           "a tied weight's gradient counted once per owner (doubled)", models=("tinylm_tied",),
           # AdamW only: under SGD at lr 1e-2 the reference tinylm_tied's loss rises over 3-5 steps,
           # so `converges` fails on the reference itself (not a cell that can judge a mutant)
           optimizers=("adamw",)),
    Mutant("frozen_updated", _spec("frozen_updated"), "split_matches_full_batch",
           "frozen parameters get gradients reduced and are stepped by the optimizer",
           models=("mlp_frozen",)),
    Mutant("bf16_reduce", _spec("bf16_reduce"), "cross_ws_replicated",
           "gradients reduced in bf16 against the policy (fp32 params, fp64 reduce)", at_steps=(1, 2)),
)

# Unmutated adapters run in the same matrix: the reference and these must pass every check.
CONTROLS: tuple[tuple[str, str], ...] = (
    ("fsdp_impl", "the product itself"),
    (_spec("meta_init"), "meta-device init by fsdp_impl.materialize_meta (control for meta_init_rng_order)"),
)


def by_name(name: str) -> Mutant:
    for m in CATALOGUE:
        if m.name == name:
            return m
    raise KeyError(f"no mutant {name!r}; known: {', '.join(m.name for m in CATALOGUE)}")

