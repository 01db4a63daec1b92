"""The user's own model, named ``"package.module:factory"`` on the command line (``--models``).

The model protocol: the named object is a `ModelSpec`, or any object with these four members, or a
zero-argument callable that returns one::

    build()                              -> nn.Module   plain fp32 CPU model, knows nothing of
                                                        parallelism; initialised from the global torch
                                                        RNG (the harness seeds it first)
    make_batch(global_batch, step, seed) -> (inputs, targets)  on CPU, the same for the same three
                                                        numbers on every call and in every process
                                                        (draw from harness.train.models.data_generator)
    loss(outputs, targets)               -> scalar      the MEAN over the batch (split data averages
                                                        ranks' means), or a mean weighted by a count each
                                                        sample carries (a token mean), which the run measures
    units(model)                         -> list[nn.Module]   submodules to shard as units, bottom-up;
                                                        a tied parameter must live in one unit

`suites/harness/unit/example_model.py` is a complete example (``--models suites.harness.unit.example_model:spec``).

Before any world starts the protocol is held once (`check_model`, run by harness/preflight.py): the forward must
draw no random numbers (`check_no_random_forward`: dropout with p > 0 is refused, naming its module), and the
loss must be a mean over the batch, of the samples or weighted by a count each sample carries (`loss_normaliser`).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from harness.core.loading import one_line, resolve

MEMBERS = ("build", "make_batch", "loss", "units")


class ModelError(ValueError):
    """A user model cannot be found, imported or used; the message is one line."""


def load_user_model(name: str):
    """The `ModelSpec` for ``"package.module:factory"``; ModelError (one line) on any problem."""
    from harness.train.model_spec import ModelSpec  # torch: only once a model is loaded

    obj, attr = resolve(name, "model", ModelError)
    if not _complete(obj) and callable(obj) and (inspect.isfunction(obj) or inspect.isclass(obj)):
        try:
            obj = obj()
        except Exception as exc:  # a user factory may raise anything
            raise ModelError(f"model {name!r}: calling {attr}() failed: {one_line(exc)}") from exc
    missing = [m for m in MEMBERS if not callable(getattr(obj, m, None))]
    if missing:
        raise ModelError(
            f"model {name!r}: {type(obj).__name__} has no {', '.join(m + '()' for m in missing)} "
            f"(a model needs {', '.join(MEMBERS)}; see harness/train/user_models.py)"
        )
    return ModelSpec(name, obj.build, obj.make_batch, obj.loss, obj.units)


def _complete(obj: object) -> bool:
    return all(callable(getattr(obj, m, None)) for m in MEMBERS)


def check_built(name: str, model: object, units: object) -> None:
    """What build() and units() returned, held to the protocol: ModelError (one line) naming the problem."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r}: build() returned {type(model).__name__}, not an nn.Module")
    if not any(True for _ in model.parameters()):
        raise ModelError(f"model {name!r}: the model build() returned has no parameters")
    if not isinstance(units, (list, tuple)) or not all(isinstance(u, nn.Module) for u in units):
        raise ModelError(f"model {name!r}: units(model) returned {type(units).__name__}, not a list of nn.Module")
    inside = {id(m) for m in model.modules()}
    strangers = [type(u).__name__ for u in units if id(u) not in inside or u is model]
    if strangers:
        raise ModelError(
            f"model {name!r}: units(model) returned {', '.join(strangers)}, which are not submodules "
            f"of the model (the root is sharded last by the harness itself)"
        )


def check_batch(name: str, batch: object, global_batch: int) -> None:
    """What make_batch returned: two tensors of `global_batch` samples each."""
    import torch

    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ModelError(f"model {name!r}: make_batch returned {type(batch).__name__}, not (inputs, targets) tensors")
    sizes = [int(t.shape[0]) if t.dim() else 0 for t in batch]
    if sizes != [global_batch, global_batch]:
        raise ModelError(
            f"model {name!r}: make_batch({global_batch}, ...) returned {sizes[0]} inputs and "
            f"{sizes[1]} targets; both must hold {global_batch} samples (dim 0)"
        )


# A mean loss read two ways, over the whole batch and as the size-weighted mean of the losses of its two
# halves, differs by rounding only: fp32 sums of a few dozen terms, a relative 1e-7 or so (each half runs
# other kernel shapes too). A sum over the samples (reduction="sum") differs by a factor 2, a relative
# difference of 1/2 or more. 1e-4 sits three orders of magnitude from both. The same holds of the gradients
# the loss gives its outputs (normaliser_shares): rounding against a share off by a sample's count.
LOSS_MEAN_RTOL = 1e-4

# How a loss normalises, as the preflight measures it (loss_normaliser): the mean over the samples, or a mean
# whose normaliser is a count the batch carries (a token mean over the non-pad tokens: F.cross_entropy with
# ignore_index, a class-weighted mean), so that the mean of the ranks' losses is not the loss of the batch.
SAMPLE_MEAN, WEIGHTED_MEAN = "sample mean", "weighted mean"


def check_model(spec, global_batch: int, seed: int, steps: int = 1) -> str:
    """The model protocol held once, in the parent, before any world starts: build() on the CPU (the
    global RNG seeded, then restored), units(model), make_batch of the run's global batch, a forward that
    draws no random numbers (check_no_random_forward), and a loss that is a mean over the batch
    (loss_normaliser, over the batches of steps 1..`steps`). ModelError (one line) names the first problem;
    returns how the loss normalises (SAMPLE_MEAN or WEIGHTED_MEAN)."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the process's own random state left as it was, a dropout's draws too
        torch.manual_seed(seed)
        return _checked(spec, global_batch, seed, steps)


def _checked(spec, global_batch: int, seed: int, steps: int) -> str:
    name = spec.name
    model = _calling(name, "build()", spec.build)
    check_built(name, model, [])  # a module with parameters, before units(model) is asked of it
    check_built(name, model, _calling(name, "units(model)", spec.units, model))
    batch = _calling(name, f"make_batch({global_batch}, 1, {seed})", spec.make_batch, global_batch, 1, seed)
    check_batch(name, batch, global_batch)
    check_no_random_forward(name, model, batch)
    kind = loss_normaliser(name, model, spec.loss, batch)
    for step in range(2, steps + 1):
        if kind == WEIGHTED_MEAN:
            break
        later = _calling(name, f"make_batch({global_batch}, {step}, {seed})", spec.make_batch, global_batch, step, seed)
        shares = normaliser_shares(name, model, spec.loss, later)
        kind = WEIGHTED_MEAN if shares is not None and shares.weighted else kind
    return kind


class RandomForwardError(ModelError):
    """The model's forward draws random numbers (dropout and the like); `module` names the first module whose
    forward drew them ('' for the model's own forward), `ops` the random ops it ran."""

    def __init__(self, message: str, module: str, ops: tuple[str, ...]) -> None:
        super().__init__(message)
        self.module, self.ops = module, ops


def check_no_random_forward(name: str, model, batch) -> None:
    """RandomForwardError (one line) where one forward of the model, in the mode build() left it in (the
    harness never switches it), runs an op that draws random numbers (random_draws). Split data would draw
    them for each rank's slice, the plain model for the whole batch: not the same numbers, whatever the seed,
    so no run could match the plain model and every implementation would be blamed for the model's
    randomness."""
    draws = random_draws(name, model, batch[0])
    if not draws:
        return
    module, ops = draws[0][0], tuple(dict.fromkeys(op for m, op in draws if m == draws[0][0]))
    kind = {path: type(m).__name__ for path, m in model.named_modules()}.get(module, module)
    where = f"module {module} ({kind})" if module else f"the model's own forward ({kind})"
    raise RandomForwardError(
        f"model {name!r}: the forward of {where} draws random numbers ({', '.join(ops)}): split data would draw "
        "them per rank's slice and the plain model for the whole batch, so no run can match it; for verification "
        "build the model without them (dropout p=0, or that module in eval mode: the harness never switches modes)",
        module,
        ops,
    )


def random_draws(name: str, model, x) -> list[tuple[str, str]]:
    """(module, op) for every op of one forward of `model` on `x` that draws random numbers, in order: the ops
    torch tags nondeterministic_seeded (bernoulli, rand, randn, randint, randperm, normal, uniform, multinomial,
    native_dropout, ...), less those told to draw nothing (a dropout probability of 0, or not in training);
    module: the innermost module whose forward ran it, by its path in the model ('' for the root's own; a module
    outside the model by its class). A forward that raises draws nothing here: the loss check names the raise."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {id(m): path for path, m in model.named_modules()}
    stack: list[str] = []
    seen: list[tuple[str, str]] = []

    class Draws(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
                seen.append((stack[-1] if stack else "", f"aten.{func.overloadpacket.__name__}"))
            return func(*args, **kwargs)

    def enter(module, _args):
        stack.append(names.get(id(module), type(module).__name__))

    def leave(module, _args, _out):
        if stack:
            stack.pop()

    hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        with Draws():
            model(x)
    except Exception:  # noqa: BLE001 - the user's forward may raise anything: the loss check names it
        return []
    finally:
        for h in hooks:
            h.remove()
    return seen


def _draws(func, args, kwargs) -> bool:
    """Whether a random op's call draws: not where its dropout probability is 0 or it is told it is not training
    (native_dropout(p=0), the fused attention kernels' dropout_p=0, which torch tags random whatever p is)."""
    for i, arg in enumerate(func._schema.arguments):
        positional = not arg.kwarg_only and i < len(args)
        value = kwargs[arg.name] if arg.name in kwargs else args[i] if positional else arg.default_value
        if arg.name in ("p", "dropout_p") and isinstance(value, (int, float)) and value == 0:
            return False
        if arg.name in ("train", "training") and value is False:
            return False
    return True


def check_loss_is_a_mean(name: str, model, loss, batch) -> None:
    """The loss must be a mean over the batch (loss_normaliser): ModelError otherwise."""
    loss_normaliser(name, model, loss, batch)


def loss_normaliser(name: str, model, loss, batch) -> str:
    """How the loss normalises the batch it is given: SAMPLE_MEAN (the mean over the samples, `mean_loss_gap`
    within LOSS_MEAN_RTOL), or WEIGHTED_MEAN (`normaliser_shares`: each sample weighs by a count of its own, as in
    a token mean over the non-pad tokens, and the batch's loss is the mean of its halves' weighted by their counts).
    ModelError for anything else: a sum (reduction='sum'), or a loss that mixes samples. Split data averages the
    ranks' losses; with a weighted mean that average is not the global mean, which the run then measures
    (harness/checks/loop.py loss_normalisation) instead of refusing the model."""
    shares = normaliser_shares(name, model, loss, batch)
    weights = shares.shares if shares is not None and shares.weighted else None
    gap = mean_loss_gap(name, model, loss, batch, weights)
    if gap is None or gap[0] <= LOSS_MEAN_RTOL:
        return WEIGHTED_MEAN if weights is not None else SAMPLE_MEAN
    rel, ratio = gap
    n = int(batch[0].shape[0])
    if weights is not None:
        raise ModelError(
            f"model {name!r}: loss(outputs, targets) weighs each sample by a count of its own (a token mean?), but the "
            f"loss of a batch of {n} differs from its halves' losses weighted by their counts by {rel:.3g} relative "
            f"(tolerance {LOSS_MEAN_RTOL:g}): the model or the loss mixes samples, so split data cannot compute it"
        )
    cause = (
        " (a sum over the samples: reduction='sum'?)"
        if abs(ratio - 2) <= 0.01
        else f" ({rel:.3g} relative: the loss mixes samples, as a contrastive loss does, or weighs each by a count "
        "of its own, as a token mean does, from outputs that are not one floating tensor of the batch's samples, "
        "the gradient of which the harness reads to measure such a normaliser)"
    )
    raise ModelError(
        f"model {name!r}: loss(outputs, targets) is not the mean over the batch: the loss of a batch of "
        f"{n} is {ratio:.3f}x the mean of its two halves' losses{cause}; split data "
        f"averages the ranks' mean losses, so the loss must be the mean (relative tolerance "
        f"{LOSS_MEAN_RTOL:g})"
    )


@dataclass(frozen=True)
class Shares:
    """What the gradients a loss gives its outputs say of its normaliser, half by half (samples 0::2, 1::2): the
    gradient of the whole batch's loss on a half's samples is `shares[h]` x the gradient of that half's own loss
    (within `residual`, relative). A mean over the samples has shares n_h / n; a sum, 1 each; a mean weighted by a
    count each sample carries (a token mean), each half's count over the batch's."""

    shares: tuple[float, float]
    sizes: tuple[float, float]  # n_h / n
    residual: float

    @property
    def proportional(self) -> bool:
        """Each half's gradient a multiple of the whole's on its samples: no sample's loss depends on another."""
        return self.residual <= LOSS_MEAN_RTOL

    @property
    def weighted(self) -> bool:
        """A mean whose normaliser is a count summed over the samples (the shares add up to 1) that is not the
        samples' count (some share off n_h / n)."""
        return (
            self.proportional
            and abs(sum(self.shares) - 1) <= LOSS_MEAN_RTOL
            and any(abs(c / s - 1) > LOSS_MEAN_RTOL for c, s in zip(self.shares, self.sizes))
        )


def normaliser_shares(name: str, model, loss, batch) -> Shares | None:
    """The loss's normaliser, read from the gradients it gives the model's outputs (the model in eval mode,
    without gradients; the loss alone differentiated, on the whole batch's outputs and on each half's): `Shares`.
    None where the outputs are not one floating tensor of the batch's samples, the loss does not differentiate
    them, or a half's gradient is zero: the loss values alone are then asked (mean_loss_gap)."""
    import torch

    x, y = batch
    n = int(x.shape[0])
    if n < 2:
        return None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception:  # noqa: BLE001 - the user's forward may raise anything: mean_loss_gap names it
        return None
    finally:
        model.train(was_training)
    if not (isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() and out.shape[0] == n):
        return None
    whole = _output_grad(loss, out, y)
    if whole is None:
        return None
    shares, sizes, residual = [], [], 0.0
    for i in (0, 1):
        part, mine = _output_grad(loss, out[i::2], y[i::2]), whole[i::2]
        if part is None or not float(part.norm()) or not float(mine.norm()):
            return None
        c = float((mine * part).sum() / (part * part).sum())
        shares.append(c)
        sizes.append(int(part.shape[0]) / n)
        residual = max(residual, float((mine - c * part).norm() / mine.norm()))
    if not all(math.isfinite(v) for v in (*shares, residual)):
        return None
    return Shares(tuple(shares), tuple(sizes), residual)


def _output_grad(loss, out, y):
    """d loss(out, y) / d out in float64, or None where the loss does not differentiate its outputs (or raises:
    the value check names a loss that raises)."""
    import torch

    o = out.detach().clone().requires_grad_(True)
    try:
        with torch.enable_grad():
            value = loss(o, y)
            (grad,) = torch.autograd.grad(value, o, allow_unused=True)
    except Exception:  # noqa: BLE001 - not differentiable here: mean_loss_gap asks the values
        return None
    return None if grad is None else grad.double()


def mean_loss_gap(name: str, model, loss, batch, weights=None) -> tuple[float, float] | None:
    """(relative difference, ratio) of the loss of the batch and the size-weighted mean of the losses of
    its two halves (samples 0::2 and 1::2, as two ranks split it), relative to the halves' mean |loss|;
    `weights`: the halves' weights instead of their sizes (a weighted mean's shares, normaliser_shares).
    Run in eval mode, without gradients: batch statistics (BatchNorm) make a loss depend on
    the batch it is in beyond its reduction, which is not what this asks. None where there is nothing
    to compare: a batch of one sample, halves whose losses are both 0, or a loss that is not finite (a model
    whose outputs are NaN or Inf breaks no loss protocol: the run's `finite` check names where it appears)."""
    import torch

    x, y = batch
    n = int(x.shape[0])
    if n < 2:
        return None
    halves = [(x[i::2], y[i::2]) for i in (0, 1)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = _scalar_loss(name, loss, model, x, y)
            parts = [_scalar_loss(name, loss, model, hx, hy) for hx, hy in halves]
    finally:
        model.train(was_training)
    if not all(math.isfinite(v) for v in (whole, *parts)):
        return None
    weights = weights or [int(hx.shape[0]) / n for hx, _ in halves]
    mean = sum(w * v for w, v in zip(weights, parts))
    scale = sum(abs(v) for v in parts) / 2
    if not scale:
        return None
    return abs(whole - mean) / scale, whole / mean if mean else float("inf")


def _scalar_loss(name: str, loss, model, x, y) -> float:
    value = _calling(name, "loss(model(inputs), targets)", lambda: loss(model(x), y))
    if not (hasattr(value, "numel") and value.numel() == 1):
        raise ModelError(
            f"model {name!r}: loss(model(inputs), targets) returned {type(value).__name__}"
            f"{' of shape ' + str(tuple(value.shape)) if hasattr(value, 'shape') else ''}, not a scalar"
        )
    return float(value)


def _calling(name: str, what: str, fn, *args):
    """fn(*args); a raise of the user's code becomes one ModelError line naming the call."""
    try:
        return fn(*args)
    except ModelError:
        raise
    except Exception as exc:  # the user's code may raise anything
        raise ModelError(f"model {name!r}: {what} raised {one_line(exc)}") from exc
