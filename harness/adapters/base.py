"""The adapter protocol: the one thing a user implements to put an FSDP/ZeRO-3 (or any data-
parallel) implementation under the harness.

Subclass ``Adapter`` (or write any object with the same methods) and pass it by name:
``--impl mypkg.mymod:MyAdapter`` (an instance, a subclass, or a zero-argument factory).
Every rank of a world runs, per scenario::

    torch.manual_seed(seed); model = spec.build()            # same plain fp32 CPU model everywhere
    wrapped = adapter.wrap(model, spec.units(model), group=group, device=device, options=options)
    opt = adapter.make_optimizer(wrapped, name="adamw", lr=1e-2)
    for step: loss = spec.loss(wrapped(x_local), y_local); loss.backward()
              adapter.after_backward(wrapped, opt); opt.step(); opt.zero_grad()
              full = adapter.full_params(wrapped)             # every rank, collectively

Methods:

- ``wrap`` (required): shard ``model`` over ``group`` (a ``torch.distributed`` process group;
  pass it explicitly, never assume WORLD) and return the module to train. ``units`` are the
  submodules to shard as separate units, bottom-up; the root is expected to be wrapped last.
  Move the model to ``device`` (``cpu`` for gloo, ``cuda:i`` for nccl). The gradient the
  optimizer sees must be the MEAN over ranks (each rank's loss is its local-batch mean).
  ``options`` (a ``WrapOptions``) carries every setting of the wrap at once: mixed precision (param and
  reduce dtype), a hybrid mesh (shard and replicate groups), an integer ``reshard_after_forward``, a shard
  placement, CPU offload. An adapter declares the settings its ``wrap`` honours in ``wrap_settings``
  (``harness.core.features.WRAP_SETTINGS``); a feature, or a composition of features, that needs a setting it
  does not declare is not run (``unsupported``). Where the implementation refuses a composition it otherwise
  takes, ``refuses(feature) -> str | None`` says why, and those scenarios are ``unsupported`` with that reason
  (FSDP2 refuses ``reshard2+shard1``); a ``refuses`` that also takes an ``optimizer`` keyword is asked with the
  scenario's optimizer name, for a feature it takes with some optimizers only (DeepSpeed's ``ckpt`` with SGD).
  A ``wrap`` without ``options`` is the plain wrap alone.
- ``make_optimizer``: default ``harness.optimizers.make_optimizer(wrapped.parameters(), name, lr)``.
  ``name`` is ``"adamw"``, ``"sgd"`` or a user's ``"package.module:factory"`` (``--optimizers``), which
  that function builds as ``factory(params, lr=lr)``; an override should build every name through it,
  so that the reference and the implementation step the same optimizer. A per-matrix optimizer (its
  update depends on the whole matrix) must see whole matrices: DTensor parameters, as fsdp_impl and FSDP2
  have, reduce its norm over the mesh; a shard stepped as a matrix is the fault the harness catches.
- ``after_backward``: called after ``backward()`` and before ``step()``; wait for outstanding
  gradient communication here. Default: nothing.
- ``full_params`` (required): the full, unsharded parameters keyed by the UNWRAPPED module's
  names (``model.named_parameters()``: ``"blocks.0.attn.wq.weight"``, a tied weight once),
  as detached fp32 CPU copies. Called on every rank (it may be collective). One that takes the keyword
  ``rank0_only`` is called with ``rank0_only=True`` for the per-step snapshots, which rank 0 alone writes: it
  returns them on rank 0 and ``{}`` (or None) elsewhere, and a gather to one rank lets the others send and go on
  where an all-gather holds every rank until all have sent. The same method either way, so an override of it is
  what the harness reads.
- ``sharded``: ``False`` for implementations that keep a full replica per rank (DDP); memory
  checks then expect no per-rank reduction of parameter and optimizer state.

Capabilities (optional methods a feature needs, ``harness.core.features.REGISTRY``; a scenario
whose adapter lacks one is not run and gets an ``unsupported`` verdict, never a pass):

- ``set_gradient_sync(wrapped, enabled: bool)`` (feature ``no_sync``): switch the gradient reduction
  off for the following backward passes (the gradients accumulate unreduced) and back on; FSDP2's
  ``set_requires_gradient_sync``, DDP's ``no_sync``.
- ``clip_grad_norm(wrapped, max_norm, norm_type) -> float`` (features ``clip``, ``clip_inf``): scale the
  gradients so that their GLOBAL norm (over all ranks' shards) is at most ``max_norm``, as
  ``torch.nn.utils.clip_grad_norm_`` does for one unsharded model; return the norm before clipping.
- ``save_checkpoint(wrapped, optimizer, path)`` and ``load_checkpoint(wrapped, optimizer, path)`` (feature
  ``ckpt``): collective; save the parameters and the optimizer state into the directory ``path`` (every
  rank its own part, or however the implementation checkpoints), and load them into a freshly wrapped
  model and optimizer of the same kind at ANY world size, after which training goes on as if it had
  never stopped. ``path`` is on a file system every rank sees.
- ``invariant_forward_backward(wrapped, loss_fn, inputs, targets, *, micro_batches, replicated) -> loss`` with the
  attribute ``batch_invariant = True`` (the batch-invariant tier, ``--invariant``, harness/invariant): one step's
  forward and backward whose result does not depend on the world size: the global batch as ``micro_batches`` = L
  equal micro-batches, each loss / L, the gradients summed in one fixed binary tree over the micro-batch index.
  ``inputs``/``targets``: the rank's contiguous 1 / W of the global batch, or the whole batch when
  ``replicated``. Returns the global batch's mean loss, the same on every rank. The tier holds such an
  implementation bitwise to itself at every world size and to the plain model summing the same tree.

The wrap settings (``WrapOptions``; the feature that asks for each):

- ``mixed_precision`` (``bf16``): forward and backward on ``param_dtype`` copies of the parameters (floating
  inputs cast to it), fp32 master parameters that the optimizer steps, gradients reduced in ``reduce_dtype``;
  FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
- ``hybrid`` (``hsdp``): each parameter sharded over ``shard_group`` and replicated across ``replicate_group``
  (the ranks holding the same shard); the gradient is still the mean over every rank of ``group``. The
  harness makes both groups (rank = replica x shard size + index in the shard group).
- ``reshard_after_forward`` (``reshard2``): each unit, after its forward, resharded to groups of
  ``reshard_after_forward`` consecutive ranks of the shard group (a divisor of its size; each rank keeps that
  fraction of the unit until its backward, which gathers within the group), FSDP2's integer
  ``reshard_after_forward``. 1 means keep the unit gathered until backward, the shard group's size (True) means
  reshard fully (the plain wrap).
- ``shard_placement`` (``shard1``): each parameter sharded on the dim ``shard_placement_fn(parameter)`` names (a
  ``Shard(d)``; None: dim 0), as FSDP2's ``shard_placement_fn``; the harness asks for ``Shard(1)`` only where
  dim 1 divides evenly over the shard group.
- ``offload`` (``offload``): the sharded parameters, their gradients and the optimizer state in host memory,
  forward and backward on ``device``, FSDP2's ``CPUOffloadPolicy``. On a GPU the harness checks that the device
  holds none of that state after a step.

Deprecated: the one-setting wraps of the earlier protocol, ``wrap_mixed_precision(model, units, *, group, device,
param_dtype, reduce_dtype)``, ``wrap_hybrid(..., shard_group, replicate_group)``, ``wrap_reshard_after_forward(...,
reshard_after_forward)``, ``wrap_shard_placement(..., shard_placement_fn)`` and ``wrap_offload(...)``, still run
the feature each one stands for alone (``call_wrap`` translates); a composition of two needs ``wrap(...,
options)``.

Engine hooks, for implementations that drive backward and the optimizer step themselves (DeepSpeed's engine:
``engine.backward(loss)``, ``engine.step()``), each optional, each used by every feature where it applies:

- ``backward(wrapped, loss)``: one micro-batch's backward. ``loss`` is that micro-batch's own mean loss, NOT
  divided by the step's micro-batches: the engine averages over its accumulation (``options.micro_batches``,
  given at ``wrap``). Without the hook the harness runs ``(loss / micro_batches).backward()``.
- ``step(wrapped, optimizer)``: called after EVERY micro-batch's backward, as an engine counts its micro-steps;
  it updates the parameters at the step's last micro-batch (its accumulation boundary), with the clipping
  ``options.clip`` asks for where the adapter declares the ``clipping`` setting (then ``clip_grad_norm`` is
  not needed). Without the hook: ``optimizer.step()`` once, after the last.
- ``zero_grad(wrapped, optimizer)``: after the step. Without the hook: ``optimizer.zero_grad(set_to_none=True)``.

A short example (docs/adapters.md#engines-implementations-that-drive-their-own-step has it whole)::

    class MyEngine(Adapter):
        wrap_settings = frozenset({"accumulation", "clipping"})

        def wrap(self, model, units, *, group, device, options=WrapOptions()):
            return MyEngineModule(model, group, accumulate=options.micro_batches, clip=options.clip)

        def backward(self, wrapped, loss):
            wrapped.backward(loss)  # the engine divides by its accumulation

        def step(self, wrapped, optimizer):
            wrapped.step()  # a no-op but at the accumulation boundary
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from harness.core.features import REGISTRY, WRAP_SETTINGS, parts, wrap_settings
from harness.optimizers import make_optimizer as _make_optimizer

REQUIRED = ("wrap", "full_params")
# optimizer_state(wrapped, optimizer) -> {parameter name: {state key: whole tensor or scalar}}: for an optimizer whose
# own parameters are not the model's (an engine's flat partitions), the state each model parameter has, read from
# the optimizer's buffers (collective: every rank calls it); the harness otherwise reads the optimizers itself
OPTIONAL = ("make_optimizer", "after_backward", "optimizer_state")
ENGINE_HOOKS = ("backward", "step", "zero_grad")
CAPABILITIES = (
    "set_gradient_sync",
    "clip_grad_norm",
    "save_checkpoint",
    "load_checkpoint",
    "invariant_forward_backward",
    "refuses",
    *WRAP_SETTINGS.values(),  # the deprecated one-setting wraps
)


class AdapterError(ValueError):
    """An adapter cannot be found, imported, completed or run; the message is one line."""


@dataclass(frozen=True)
class WrapOptions:
    """Every setting of one wrap at once. A field at its default asks for nothing: ``WrapOptions()`` is the plain
    wrap. `settings` names those asked for (harness.core.features.WRAP_SETTINGS)."""

    param_dtype: torch.dtype | None = None  # mixed_precision: the compute dtype of the gathered parameters
    reduce_dtype: torch.dtype | None = None  # mixed_precision: the dtype the gradients are reduced in
    shard_group: object | None = None  # hybrid: the ranks a parameter is sharded over
    replicate_group: object | None = None  # hybrid: the ranks that hold the same shard
    reshard_after_forward: bool | int = True  # True: fully after forward; an int g: to groups of g ranks
    shard_placement_fn: Callable | None = None  # shard_placement: parameter -> Shard(d), or None for dim 0
    offload: bool = False  # offload: parameters, gradients and optimizer state in host memory
    # For an implementation that drives the step itself (engine hooks): the micro-batches one optimizer step
    # accumulates (accumulation) and the clipping it applies, (norm type, max norm) (clipping). A wrap that
    # leaves the step to the harness ignores them.
    micro_batches: int = 1
    clip: tuple[float, float] | None = None

    @property
    def settings(self) -> frozenset[str]:
        asked = {
            "mixed_precision": self.param_dtype is not None or self.reduce_dtype is not None,
            "hybrid": self.replicate_group is not None,
            "reshard_after_forward": self.reshard_after_forward is not True,
            "shard_placement": self.shard_placement_fn is not None,
            "offload": self.offload,
        }
        return frozenset(name for name, on in asked.items() if on)


PLAIN_WRAP = WrapOptions()


class Adapter:
    name: str = "adapter"
    sharded: bool = True
    batch_invariant: bool = False  # claims the batch-invariant tier (invariant_forward_backward)
    # the WrapOptions settings this adapter's wrap honours (and, for an engine, ENGINE_SETTINGS it drives)
    wrap_settings: frozenset[str] = frozenset()

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device, options: WrapOptions = PLAIN_WRAP):
        raise NotImplementedError

    def make_optimizer(self, wrapped: nn.Module, *, name: str, lr: float) -> torch.optim.Optimizer:
        return _make_optimizer(wrapped.parameters(), name, lr)

    def after_backward(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        return None

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        raise NotImplementedError


class _Completed(Adapter):
    """A duck-typed adapter object with the defaults filled in for the optional methods."""

    def __init__(self, inner: object, name: str) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", name)
        self.sharded = bool(getattr(inner, "sharded", True))
        self.batch_invariant = bool(getattr(inner, "batch_invariant", False))
        self.wrap_settings = frozenset(getattr(inner, "wrap_settings", ()))
        for method in REQUIRED + OPTIONAL + CAPABILITIES + ENGINE_HOOKS:
            if callable(getattr(inner, method, None)):
                setattr(self, method, getattr(inner, method))


# What an adapter can do #


def takes_options(adapter: object) -> bool:
    """Whether the adapter's wrap takes `options` (the composable wrap); else it is the plain wrap alone."""
    try:
        params = inspect.signature(adapter.wrap).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no options
        return False
    return "options" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def takes_rank0_only(adapter: object) -> bool:
    """Whether the adapter's full_params takes `rank0_only` (the full parameters gathered to rank 0 alone)."""
    try:
        return "rank0_only" in inspect.signature(adapter.full_params).parameters
    except (TypeError, ValueError):  # a builtin or C callable
        return False


def is_engine(adapter: object) -> bool:
    """Whether the adapter drives the step itself (the engine hooks: at least `step`)."""
    return callable(getattr(adapter, "step", None))


def declared_settings(adapter: object) -> frozenset[str]:
    """The wrap (and engine) settings the adapter's wrap honours: those it declares, where its wrap takes options."""
    return frozenset(getattr(adapter, "wrap_settings", ())) if takes_options(adapter) else frozenset()


def sharded_state(adapter: object) -> tuple[str, ...]:
    """The training state the adapter's implementation partitions over its ranks: its `sharded_state` where it
    declares one (ZeRO-1: the optimizer state; ZeRO-2: the gradients too), else all of it (ZeRO-3) when
    `sharded`, none when not (DDP)."""
    declared = getattr(adapter, "sharded_state", None)
    if declared is not None:
        return tuple(declared)
    return ("params", "grads", "optimizer_state") if getattr(adapter, "sharded", True) else ()


def missing_capability(adapter: object, feature: str, optimizer: str | None = None) -> str | None:
    """Why `adapter` cannot run `feature` (one line), or None when it can. A composition needs what each of its
    features needs: their methods, and every wrap setting at once in the one wrap (or, for one setting alone,
    the deprecated method that wraps with it); where the implementation refuses it, its own reason first (the
    adapter's `refuses`, asked with `optimizer` too where it takes that keyword)."""
    name = getattr(adapter, "name", adapter)
    why = _refusal(adapter, feature, optimizer) if parts(feature) else None
    if why:  # the implementation's own reason first
        return f"{name} refuses '{feature}': {why}"
    declared, engine = declared_settings(adapter), is_engine(adapter)
    whose = lambda part: f"feature '{part}'" + (f" of '{feature}'" if part != feature else "")  # noqa: E731
    for part in parts(feature):
        f = REGISTRY[part]
        if engine and f.engine is not None:  # an engine drives this part of the step itself
            if f.engine not in declared:
                return (
                    f"adapter '{name}' drives the step itself (engine hooks) but declares no '{f.engine}' setting "
                    f"(wrap_settings), which {whose(part)} needs (see harness/adapters/base.py)"
                )
            continue
        missing = [m for m in f.needs if not callable(getattr(adapter, m, None))]
        if missing:
            return (
                f"adapter '{name}' has no {' or '.join(m + '()' for m in missing)} method, which {whose(part)} "
                "needs (see harness/adapters/base.py)"
            )
    settings = wrap_settings(feature)
    left = [s for s in settings if s not in declared]
    legacy = [WRAP_SETTINGS[s] for s in left]
    alone = len(settings) == 1 and callable(getattr(adapter, legacy[0] if legacy else "", None))
    if left and not alone:  # (one setting alone: the deprecated method that wraps with it runs it)
        if declared or takes_options(adapter):
            return (
                f"adapter '{name}' declares no wrap setting {', '.join(repr(s) for s in left)} (its wrap_settings: "
                f"{', '.join(sorted(declared)) or 'none'}), which '{feature}' needs (see harness/adapters/base.py)"
            )
        if len(settings) > 1 and all(callable(getattr(adapter, m, None)) for m in legacy):
            return (
                f"adapter '{name}' has only the deprecated one-setting wraps ({', '.join(m + '()' for m in legacy)}): "
                f"'{feature}' needs them in one wrap(..., options=WrapOptions(...)) that declares "
                f"{', '.join(repr(s) for s in settings)} in wrap_settings (see harness/adapters/base.py)"
            )
        part = next(p for p in parts(feature) if REGISTRY[p].wrap in left)
        return (
            f"adapter '{name}' has no wrap setting '{REGISTRY[part].wrap}' (wrap_settings) nor "
            f"{WRAP_SETTINGS[REGISTRY[part].wrap]}() method, which {whose(part)} needs (see harness/adapters/base.py)"
        )
    return None


def _refusal(adapter: object, feature: str, optimizer: str | None) -> str | None:
    """The adapter's own reason for refusing `feature` (with `optimizer`, where its `refuses` takes that keyword)."""
    refuses = getattr(adapter, "refuses", None)
    if not callable(refuses):
        return None
    try:
        takes_optimizer = "optimizer" in inspect.signature(refuses).parameters
    except (TypeError, ValueError):
        takes_optimizer = False
    return refuses(feature, optimizer=optimizer) if takes_optimizer and optimizer is not None else refuses(feature)


def call_wrap(adapter, model: nn.Module, units: list[nn.Module], *, group, device, options: WrapOptions) -> nn.Module:
    """The adapter's wrap with `options`: its composable wrap where it takes them, else, for one wrap setting,
    the deprecated method that wraps with it alone, else the plain wrap (missing_capability refused the rest)."""
    settings = options.settings
    if takes_options(adapter):
        return adapter.wrap(model, units, group=group, device=device, options=options)
    if not settings:
        return adapter.wrap(model, units, group=group, device=device)
    if len(settings) > 1:
        raise AdapterError(
            f"adapter '{getattr(adapter, 'name', adapter)}': the settings {', '.join(sorted(settings))} need one "
            "wrap(..., options) (see harness/adapters/base.py)"
        )
    (setting,) = settings
    legacy = getattr(adapter, WRAP_SETTINGS[setting])
    kw = {"group": group, "device": device}
    if setting == "mixed_precision":
        kw |= {"param_dtype": options.param_dtype, "reduce_dtype": options.reduce_dtype}
    elif setting == "hybrid":
        kw |= {"shard_group": options.shard_group, "replicate_group": options.replicate_group}
    elif setting == "reshard_after_forward":
        kw |= {"reshard_after_forward": options.reshard_after_forward}
    elif setting == "shard_placement":
        kw |= {"shard_placement_fn": options.shard_placement_fn}
    return legacy(model, units, **kw)


def torch_clip(parameters, max_norm: float, norm_type: float) -> float:
    """``torch.nn.utils.clip_grad_norm_``; the norm before clipping as a float (a DTensor's in full)."""
    total = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)
    full = getattr(total, "full_tensor", None)
    return float(full() if callable(full) else total)


def cpu_fp32(t: Tensor) -> Tensor:
    """A detached fp32 CPU copy that shares no storage with `t`."""
    return t.detach().to(device="cpu", dtype=torch.float32, copy=True)


def strip_prefixes(name: str, prefixes: tuple[str, ...]) -> str:
    """Remove wrapper segments (``_fsdp_wrapped_module.``, ``module.``, ...) anywhere in a name."""
    for prefix in prefixes:
        name = name.replace(prefix, "")
    return name


def as_adapter(obj: object, label: str) -> Adapter:
    """Accept an Adapter instance, an Adapter subclass / zero-argument factory, or any object
    with ``wrap`` and ``full_params``; raise AdapterError naming a missing required method."""
    if inspect.isclass(obj) or (callable(obj) and not _has_required(obj)):
        try:
            obj = obj()
        except Exception as exc:  # a user factory may raise anything
            raise AdapterError(
                f"adapter {label!r}: calling {getattr(obj, '__name__', obj)!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    for method in REQUIRED:
        fn = getattr(obj, method, None)
        if not callable(fn) or getattr(type(obj), method, None) is getattr(Adapter, method):
            raise AdapterError(
                f"adapter {label!r} has no {method}() method (required: "
                f"{', '.join(REQUIRED)}; see harness/adapters/base.py)"
            )
    return obj if isinstance(obj, Adapter) else _Completed(obj, label)


def _has_required(obj: object) -> bool:
    return all(callable(getattr(obj, m, None)) for m in REQUIRED)
