"""The adapter protocol: the one thing a user implements to put an FSDP/ZeRO-3 (or any data-
parallel) implementation under the harness.

Subclass ``Adapter`` (or write any object with the same methods) and pass it by name:
``--impl mypkg.mymod:MyAdapter`` (an instance, a subclass, or a zero-argument factory).
Every rank of a world runs, per scenario::

    torch.manual_seed(seed); model = spec.build()            # same plain fp32 CPU model everywhere
    wrapped = adapter.wrap(model, spec.units(model), group=group, device=device)
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
  as detached fp32 CPU copies. Called on every rank (it may be collective).
- ``sharded``: ``False`` for implementations that keep a full replica per rank (DDP); memory
  checks then expect no per-rank reduction of parameter and optimizer state.

Capabilities (optional methods a feature needs, ``harness.core.scenario.FEATURE_NEEDS``; a scenario
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
- ``wrap_mixed_precision(model, units, *, group, device, param_dtype, reduce_dtype)`` (feature ``bf16``):
  ``wrap`` under a mixed-precision policy: forward and backward on ``param_dtype`` copies of the
  parameters (floating inputs cast to it), fp32 master parameters that the optimizer steps, gradients
  reduced in ``reduce_dtype``; FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``.
- ``wrap_hybrid(model, units, *, group, device, shard_group, replicate_group)`` (feature ``hsdp``): ``wrap``
  with each parameter sharded over ``shard_group`` and replicated across ``replicate_group`` (the ranks
  holding the same shard); the gradient is still the mean over every rank of ``group``. The harness
  makes both groups (rank = replica x shard size + index in the shard group).
- ``wrap_reshard_after_forward(model, units, *, group, device, reshard_after_forward: int)`` (feature
  ``reshard2``): ``wrap`` with each unit, after its forward, resharded to groups of ``reshard_after_forward``
  consecutive ranks of ``group`` (a divisor of its size; each rank keeps that fraction of the unit until its
  backward, which gathers within the group), FSDP2's integer ``reshard_after_forward``. 1 means keep the
  unit gathered until backward, the size of ``group`` means reshard fully (the plain ``wrap``).
- ``wrap_shard_placement(model, units, *, group, device, shard_placement_fn)`` (feature ``shard1``): ``wrap``
  with each parameter sharded on the dim ``shard_placement_fn(parameter)`` names (a ``Shard(d)``; None: dim 0),
  as FSDP2's ``shard_placement_fn``; the harness asks for ``Shard(1)`` only where dim 1 divides evenly.
- ``invariant_forward_backward(wrapped, loss_fn, inputs, targets, *, micro_batches, replicated) -> loss`` with the
  attribute ``batch_invariant = True`` (the batch-invariant tier, ``--invariant``, harness/invariant): one step's
  forward and backward whose result does not depend on the world size: the global batch as ``micro_batches`` = L
  equal micro-batches, each loss / L, the gradients summed in one fixed binary tree over the micro-batch index.
  ``inputs``/``targets``: the rank's contiguous 1 / W of the global batch, or the whole batch when
  ``replicated``. Returns the global batch's mean loss, the same on every rank. The tier holds such an
  implementation bitwise to itself at every world size and to the plain model summing the same tree.
- ``wrap_offload(model, units, *, group, device)`` (feature ``offload``): ``wrap`` with the sharded parameters,
  their gradients and the optimizer state in host memory and forward and backward on ``device``, FSDP2's
  ``CPUOffloadPolicy``. On a GPU the harness checks that the device holds none of that state after a step.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from harness.optimizers import make_optimizer as _make_optimizer

REQUIRED = ("wrap", "full_params")
OPTIONAL = ("make_optimizer", "after_backward")
CAPABILITIES = (
    "set_gradient_sync",
    "clip_grad_norm",
    "save_checkpoint",
    "load_checkpoint",
    "wrap_mixed_precision",
    "wrap_hybrid",
    "wrap_reshard_after_forward",
    "wrap_shard_placement",
    "wrap_offload",
    "invariant_forward_backward",
)


class AdapterError(ValueError):
    """An adapter cannot be found, imported, completed or run; the message is one line."""


class Adapter:
    name: str = "adapter"
    sharded: bool = True
    batch_invariant: bool = False  # claims the batch-invariant tier (invariant_forward_backward)

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
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
        for method in REQUIRED + OPTIONAL + CAPABILITIES:
            if callable(getattr(inner, method, None)):
                setattr(self, method, getattr(inner, method))


def missing_capability(adapter: object, feature: str) -> str | None:
    """Why `adapter` cannot run `feature` (one line), or None when it can."""
    from harness.core.scenario import FEATURE_NEEDS, parts

    for part in parts(feature):  # a composition needs what each of its features needs
        missing = [m for m in FEATURE_NEEDS.get(part, ()) if not callable(getattr(adapter, m, None))]
        if missing:
            return (
                f"adapter '{getattr(adapter, 'name', adapter)}' has no {' or '.join(m + '()' for m in missing)} "
                f"method, which feature '{part}'"
                + (f" of '{feature}'" if part != feature else "")
                + " needs (see harness/adapters/base.py)"
            )
    return None


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
