"""Frozen scenarios: one cell of the (impl x model x world size x data mode x optimizer x feature) matrix."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

DATA_MODES = ("replicated", "split")
OPTIMIZERS = ("adamw", "sgd")  # built in; --optimizers also takes a user's "package.module:factory"
# The plain, non-sharded model trained on the full global batch in one process.
REFERENCE_IMPL = "reference"
# What one training step does besides forward, backward and the optimizer step (harness/train/features.py):
#   plain    one forward and backward on the rank's batch
#   accum    the rank's batch in ACCUM_MICRO_BATCHES micro-batches, a forward and backward each (every
#            backward reduces its gradient, which the implementation must ADD to the one before), then
#            one optimizer step; the loss of each micro-batch is scaled by 1 / ACCUM_MICRO_BATCHES
#   no_sync  the same micro-batches with the gradient reduction switched off on all but the last
#            (the adapter's set_gradient_sync): the unsharded gradients accumulate locally and are
#            reduced once
#   clip     one forward and backward, then the gradients clipped to a global L2 norm of at most
#            CLIP["clip"][1] (the adapter's clip_grad_norm), then the optimizer step
#   clip_inf the same with the infinity norm (the largest |gradient element|)
#   ac       activation checkpointing on every unit (non-reentrant): forward keeps no activations of
#            a unit, backward runs its forward again
#   ckpt     resumed: the plain steps up to ckpt_step(steps) were trained at world size `resume_from` and
#            saved as a sharded checkpoint (parameters and optimizer state); this run loads it at its own
#            world size and trains the remaining steps (the adapter's save_checkpoint / load_checkpoint)
#   bf16     mixed precision: forward and backward in bf16 on bf16 copies of the parameters, fp32 master
#            parameters, gradients reduced and stepped in fp32 (the adapter's wrap_mixed_precision)
#   hsdp     hybrid sharding: HSDP_REPLICAS replicas of the model, each sharded over W / HSDP_REPLICAS
#            ranks; gradients averaged over all W ranks (the adapter's wrap_hybrid)
#   eval     an evaluation pass, as a training loop validates between steps: AFTER the optimizer step (and
#            before the gradients are zeroed), a torch.no_grad() forward of the wrapped model on a held-out
#            batch, eval_batch(step): the model's batch of step -k, which no training step draws (they are
#            1, 2, ...), of the global batch size, deterministic from (seed, step), cut as the data mode cuts
#            the training batch: the whole batch on every rank with replicated data, the rank's slice with
#            split data (the slices' losses all-reduced to the global batch's mean; a yardstick that sums the
#            ranks' micro-batches evaluates each slice). The model stays in training mode (the harness never calls eval(): every
#            dropout is 0, and BatchNorm's running statistics are per rank under split data). The eval loss is
#            recorded per step and held by harness/checks/features.py eval_matches (bitwise to the yardstick's
#            where the training is bitwise, else to the plain model's at the run's own parameters); the
#            timeline marks the pass and the moment after it (every child unit resharded:
#            harness/measure/timeline.py). Needs no adapter method: the training step's numbers are unchanged
#   jitter   timing perturbation: seeded, bounded delays where asynchronous work races (before each
#            collective is issued and each wait on one, after forward, before the optimizer step), injected
#            by the harness around any implementation (harness/train/jitter.py); it must change no number
#   reshard2 an integer reshard_after_forward: after its forward each unit is resharded to groups of
#            RESHARD_RANKS consecutive ranks (each rank keeps 1 / RESHARD_RANKS of it, not 1 / W), and backward
#            regathers it within its group (the adapter's wrap_reshard_after_forward, FSDP2's
#            reshard_after_forward=2); at W <= RESHARD_RANKS it is the plain step (post_forward_ranks). It must
#            change no number
#   shard1   a custom shard placement: every parameter of two or more dims whose dim 1 divides evenly over the
#            shard group sharded Shard(1), the others Shard(0) (shard_placement; the adapter's
#            wrap_shard_placement, FSDP2's shard_placement_fn). The zoo's mlp has no such parameter (odd
#            widths): its cells are the plain step; tinylm's square and 32-wide matrices are. It must change no
#            number
#   offload  parameters, gradients and optimizer state in host memory (the adapter's wrap_offload: FSDP2's
#            CPUOffloadPolicy, fsdp_impl's alike): forward and backward on the device, the optimizer step on
#            the CPU. Compared with the plain model doing the same (harness/adapters/reference.py Offloaded:
#            fp32 master parameters on the CPU, device copies for each forward); on a CPU run (gloo) host and
#            device are one memory and it must change nothing. Held by offload_host where a device exists
FEATURES = (
    "plain",
    "accum",
    "no_sync",
    "clip",
    "clip_inf",
    "ac",
    "ckpt",
    "bf16",
    "hsdp",
    "eval",
    "jitter",
    "reshard2",
    "shard1",
    "offload",
)
ACCUM_MICRO_BATCHES = 2
# Compositions: features joined by COMPOSE ("hsdp+clip") act together in one run, in FEATURES order
# whatever order they are written in. These pairs cannot: two micro-batch schemes, two clipping norms, and
# any two of bf16, hsdp, reshard2, shard1 and offload (each is a wrap of its own: the adapter protocol has no
# wrap that takes two of them).
COMPOSE = "+"
WRAPS = ("bf16", "hsdp", "reshard2", "shard1", "offload")  # the features that are a wrap of their own (wrap_for)
EXCLUSIVE = (("accum", "no_sync"), ("clip", "clip_inf")) + tuple(itertools.combinations(WRAPS, 2))


def parts(feature: str) -> tuple[str, ...]:
    """The features a (composed) feature is made of, in FEATURES order; () for plain."""
    return tuple(f for f in FEATURES if f != "plain" and f in feature.split(COMPOSE))


def has(feature: str, name: str) -> bool:
    """Whether a (composed) feature includes `name`."""
    return name in feature.split(COMPOSE)


def compose(names) -> str:
    """The canonical name of these features together ('plain' for none)."""
    names = set(names)
    chosen = [f for f in FEATURES if f != "plain" and f in names]
    return COMPOSE.join(chosen) or "plain"


def without(feature: str, *names: str) -> str:
    """The composition less `names` ('plain' when nothing is left)."""
    return compose(f for f in parts(feature) if f not in names)


def check_feature(text: str) -> str:
    """`text` (a feature, or features joined by '+') as its canonical name; ValueError (one line) if a part is
    unknown, repeated, or cannot be composed with another."""
    names = [t.strip() for t in text.split(COMPOSE)]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        where = f" in {text!r}" if len(names) > 1 else ""
        raise ValueError(
            f"unknown feature {unknown[0]!r}{where}; choose from {', '.join(FEATURES)} "
            f"(compose them with {COMPOSE!r}, e.g. hsdp{COMPOSE}clip)"
        )
    if len(set(names)) < len(names):
        raise ValueError(f"{text!r} names a feature twice")
    if "plain" in names and len(names) > 1:
        raise ValueError(f"{text!r}: plain is the step without features; it composes with nothing")
    for a, b in EXCLUSIVE:
        if a in names and b in names:
            raise ValueError(
                f"{a}{COMPOSE}{b} cannot be composed: "
                + (
                    "two micro-batch schemes"
                    if a == "accum"
                    else "two clipping norms"
                    if a == "clip"
                    else f"each is a wrap of its own (the adapter protocol has no wrap that takes both {a} and {b})"
                )
            )
    return compose(names)


def clip_of(feature: str) -> tuple[float, float] | None:
    """(norm type, max norm) of the composition's clipping part, None without one."""
    return next((CLIP[f] for f in parts(feature) if f in CLIP), None)


def rounded_per_rank(feature: str) -> bool:
    """Whether the composition rounds each rank's gradient before the reduction (ROUNDED_PER_RANK)."""
    return any(f in ROUNDED_PER_RANK for f in parts(feature))


# feature -> (norm type, max norm): below the smallest pre-clip norm the default models reach in 10
# steps under seeds 0-4 (L2 0.20, inf 0.033 on mlp), so clipping acts at every step (checked per run)
CLIP = {"clip": (2.0, 0.1), "clip_inf": (float("inf"), 0.01)}
# features that must leave every number bitwise as the plain step has it: compared with the plain reference
NUMBERS_UNCHANGED = ("ac", "ckpt", "hsdp", "jitter", "reshard2", "shard1")
# features that only change when things happen, never what is computed: the runs a run is compared with
# (reference, world size 1, other factorisation) leave them out, and each run is held bitwise to its own
# calm twin (Scenario.calm)
TIMING_ONLY = ("jitter",)
# the adapter methods a feature needs beyond the protocol's required ones (harness/adapters/base.py)
FEATURE_NEEDS = {
    "no_sync": ("set_gradient_sync",),
    "clip": ("clip_grad_norm",),
    "clip_inf": ("clip_grad_norm",),
    "ckpt": ("save_checkpoint", "load_checkpoint"),
    "bf16": ("wrap_mixed_precision",),
    "hsdp": ("wrap_hybrid",),
    "reshard2": ("wrap_reshard_after_forward",),
    "shard1": ("wrap_shard_placement",),
    "offload": ("wrap_offload",),
}
HSDP_REPLICAS = 2  # replicas of a hybrid mesh at W >= 2 (2 x 1 at W = 2, 2 x 2 at 4, 2 x 4 at 8)
# Features under which every rank rounds its own gradient before the reduction sums it: under bf16 each
# rank's backward yields bf16 values, which the fp32 reduction adds up. With split data at W ranks that is
# not the full batch's bf16 gradient (rounded once, from all samples) but W partial gradients rounded
# apart, so such a run is compared with the plain model accumulating the same W micro-batches (rank r's
# slice each, loss scaled by 1 / W): the same kernels on the same shapes, the same bf16 values, summed in
# fp32 (Scenario.micro_batches; harness/core/policy.py BF16_SPLIT says what bound follows)
ROUNDED_PER_RANK = ("bf16",)
# features whose sharded step computes a scalar of the whole gradient (the L2 clipping norm) from W partial
# sums, so it differs from one rank's in the last bits: their noise probes include a nudged one (Scenario.nudge).
# A user's optimizer may do the same (a whole-matrix norm): its runs get nudged probes too (Scenario.is_nudged)
NUDGED = ("clip",)


RESHARD_RANKS = 2  # reshard2: the ranks of the group each unit is resharded to after forward


def post_forward_ranks(feature: str, world_size: int) -> int:
    """Ranks a unit is spread over between its forward and its backward: RESHARD_RANKS under reshard2 (the
    integer reshard_after_forward an adapter is handed; all W ranks where W <= RESHARD_RANKS: then it is
    the plain step), else every rank of the shard group."""
    shard = shard_size(feature, world_size)
    return min(RESHARD_RANKS, shard) if has(feature, "reshard2") else shard


def ckpt_step(steps: int) -> int:
    """The step after which a ckpt run's checkpoint is saved (and from which the loading run goes on)."""
    return steps // 2


def hsdp_mesh(world_size: int) -> tuple[int, int]:
    """(replicas, shard size) of the hybrid mesh at `world_size`; rank = replica x shard size + shard index."""
    replicas = HSDP_REPLICAS if world_size % HSDP_REPLICAS == 0 else 1
    return replicas, world_size // replicas


def shard_size(feature: str, world_size: int) -> int:
    """Ranks one parameter is sharded over: all of them, or one replica's under hybrid sharding."""
    return hsdp_mesh(world_size)[1] if has(feature, "hsdp") else world_size


def _stored_int(row, column: str, default: int) -> int:
    """An integer column of a table row; `default` where a table stored before the column existed has
    none (missing, NaN or empty)."""
    value = getattr(row, column, default)
    try:
        return default if value != value else int(value)
    except (TypeError, ValueError):
        return default


def resume_of(row) -> int:
    """A table row's resume_from (0: trained from scratch; a row stored before ckpt existed has none)."""
    return _stored_int(row, "resume_from", 0)


def widest(row) -> int:
    """The largest world size a row's trajectory was trained at: a resumed run's first steps were
    trained where its checkpoint was saved, so it is held to the bounds of the wider of the two."""
    return max(int(row.world_size), resume_of(row))


def micro_batches_of(row) -> int:
    """A table row's micro_batches (1 where the column is missing: a run stored before it existed)."""
    return max(1, _stored_int(row, "micro_batches", 1))


def reverse_micro_of(row) -> bool:
    """A table row's reverse_micro (False where the column is missing)."""
    return bool(_stored_int(row, "reverse_micro", 0))


def backend_of(row) -> str:
    """A table row's backend; a row stored before the column existed (or empty) ran on gloo."""
    backend = getattr(row, "backend", "gloo")
    return backend if isinstance(backend, str) and backend else "gloo"


def feature_of(row) -> str:
    """A table row's feature; a row stored before features existed (no column, or empty) is plain."""
    feature = getattr(row, "feature", "plain")
    return feature if isinstance(feature, str) and feature else "plain"


def passes_per_step(feature: str) -> int:
    """Forward and backward passes in one training step: each gathers the parameters."""
    return ACCUM_MICRO_BATCHES if has(feature, "accum") or has(feature, "no_sync") else 1


def reductions_per_step(feature: str) -> int:
    """Gradient reductions in one training step."""
    return ACCUM_MICRO_BATCHES if has(feature, "accum") else 1


def holds_unsharded_grads(feature: str) -> bool:
    """Whether the step keeps every unit's unsharded gradient between passes (no reduction until the last)."""
    return has(feature, "no_sync")


@dataclass(frozen=True)
class Scenario:
    impl: str  # registry name ("fsdp_impl", "torch_fsdp2", ...) or "package.module:object"
    model: str  # model zoo name ("mlp", "tinylm", ...)
    world_size: int
    data_mode: str  # "replicated": every rank trains on the global batch; "split": 1/W slice each
    optimizer: str  # "adamw" | "sgd" (SGD with momentum) | a user's "package.module:factory" (user_optimizer)
    steps: int = 10
    seed: int = 0
    lr: float = 1e-2
    global_batch: int = 16
    backend: str = "gloo"  # "gloo" (CPU) | "nccl" (CUDA)
    feature: str = "plain"  # FEATURES
    resume_from: int = 0  # ckpt: the world size its checkpoint was saved at (0: trained from scratch)
    # the plain reference only: its step sums the gradients of this many micro-batches of the global
    # batch, micro-batch r being rank r's slice of a split run at that many ranks (ROUNDED_PER_RANK,
    # noise_probes); a feature with micro-batches of its own cuts each slice into its own
    micro_batches: int = 1
    reverse_micro: bool = False  # a noise probe only: its micro-batches in reverse rank order
    # a noise probe of a NUDGED feature only: its clipping coefficient moved by this many fp32 ulps
    # (max_norm x (1 + nudge x 2^-23)), as a sharded norm summed from W partial sums may move it; with a user's
    # optimizer and no clipping, every gradient the optimizer reads is scaled by that factor instead
    nudge: int = 0

    def __post_init__(self) -> None:
        if COMPOSE in self.feature:  # one name per composition, whatever order it was written in
            object.__setattr__(self, "feature", check_feature(self.feature))

    @property
    def id(self) -> str:
        """Stable readable id, e.g. ``fsdp_impl-mlp-ws4-split-adamw`` (``...-adamw-accum`` with a feature)."""
        return scenario_id(
            self.impl,
            self.model,
            self.world_size,
            self.data_mode,
            self.optimizer,
            self.seed,
            self.feature,
            self.resume_from,
            self.micro_batches,
            self.reverse_micro,
            self.nudge,
        )

    @classmethod
    def of_row(cls, row) -> Scenario:
        """The scenario of a scenarios-table row."""
        return cls(
            row.impl,
            row.model,
            int(row.world_size),
            row.data_mode,
            row.optimizer,
            seed=int(row.seed),
            feature=feature_of(row),
            resume_from=resume_of(row),
            micro_batches=micro_batches_of(row),
            reverse_micro=reverse_micro_of(row),
            nudge=_stored_int(row, "nudge", 0),
            backend=backend_of(row),
        )

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def reference(self) -> Scenario:
        """The scenario whose trajectory this one is compared with: the plain model, full batch, doing
        the same feature (the same micro-batches, the same mixed precision, ...); for a feature that must
        not change the numbers at all (NUMBERS_UNCHANGED), the plain model doing the plain step. Split
        data at W ranks under a feature that rounds per rank (ROUNDED_PER_RANK) is compared with the plain
        model summing the gradients of the W ranks' micro-batches. The plain model in bf16 is itself
        compared with the plain model in fp32 on the whole batch (what bf16 alone does)."""
        dropped = NUMBERS_UNCHANGED + (("bf16",) if self.impl == REFERENCE_IMPL else ())
        per_rank = self.impl != REFERENCE_IMPL and rounded_per_rank(self.feature) and self.data_mode == "split"
        return dataclasses.replace(
            self,
            impl=REFERENCE_IMPL,
            world_size=1,
            data_mode="replicated",
            feature=without(self.feature, *dropped),
            resume_from=0,
            micro_batches=self.world_size if per_rank else 1,
            reverse_micro=False,
            nudge=0,
        )

    def noise_probes(self) -> list[Scenario]:
        """Split data at W ranks: the plain model doing this run's step on the same global batch cut into
        the slices the W ranks take (rank r's slice as micro-batch r, every loss scaled by 1 / W, the
        gradients summed), one probe per world size the trajectory was trained at. A probe is a correct
        split computation without any sharding code; how far it lands from the full-batch reference,
        parameter by parameter, is the model's own sensitivity to that cut (its noise floor,
        harness/core/policy.py NOISE_FLOOR), and for a model whose layers use batch statistics it is the
        equivalent computation itself. Where more than 2 micro-batch gradients are summed (beyond 2 ranks,
        or 2 ranks with the feature's own micro-batches) a second probe takes the slices in reverse order:
        autograd then sums the same gradients in another order, as a sharded reduction may (2 addends
        sum alike in either order). None for replicated data or a reference; for a feature whose split
        runs are compared with the rank-order micro-batch reference itself (ROUNDED_PER_RANK), only the
        reversed one. Under a NUDGED feature (clip) or a user's optimizer, at W > 1 in either data mode, one
        more probe per world size has its clipping coefficient (without clip: every gradient the optimizer
        reads) nudged by W ulps: what the sharded norm's other order of summation changes."""
        if self.impl == REFERENCE_IMPL:
            return []
        ref, k = self.reference(), passes_per_step(self.feature)
        sizes = sorted({self.world_size, self.resume_from} - {0, 1})
        nudged = self.is_nudged()
        if self.data_mode != "split":
            return [ref.replace(nudge=w) for w in sizes] if nudged else []
        if rounded_per_rank(self.feature):  # its reference is the rank-order probe: only the order is left
            return [ref.replace(reverse_micro=True)] if ref.micro_batches * k > 2 else []
        return [
            ref.replace(micro_batches=w, reverse_micro=rev)
            for w in sizes
            for rev in ((False, True) if w * k > 2 else (False,))
        ] + [ref.replace(micro_batches=w, nudge=w) for w in sizes if nudged]

    def is_nudged(self) -> bool:
        """Whether a sharded run of this scenario may compute a scalar of a whole gradient from W partial sums
        (the L2 clipping norm, or a user's optimizer's whole-matrix norm), so that its noise probes include
        nudged ones ([Note: user optimizer] in harness/core/policy.py)."""
        return any(has(self.feature, f) for f in NUDGED) or user_optimizer(self.optimizer)

    def rank_order_probe(self, at: int | None = None) -> Scenario | None:
        """The noise probe a run is held against directly: for a split run, the probe in rank order at its
        own world size (or at `at`, another world size its trajectory was trained at); for a probe in
        reverse order, its twin in rank order (what the order changed)."""
        if self.reverse_micro or self.nudge:
            return self.replace(reverse_micro=False, nudge=0) if self.micro_batches > 1 else None
        at = self.world_size if at is None else at
        return next(
            (p for p in self.noise_probes() if p.micro_batches == at and not p.reverse_micro and not p.nudge), None
        )

    def saver(self) -> Scenario | None:
        """The run whose checkpoint a ckpt run resumes from: the same implementation's plain run at
        `resume_from` ranks (it saves after ckpt_step(steps)); None for any other run."""
        if not has(self.feature, "ckpt"):
            return None
        return dataclasses.replace(
            self, world_size=self.resume_from or self.world_size, feature=without(self.feature, "ckpt"), resume_from=0
        )

    def dependencies(self) -> list[Scenario]:
        """The runs this one's checks compare with: the reference, the noise probes of split data, for a
        sharded run at W > 1 the same implementation at world size 1 in the same data mode, and the run a
        checkpoint comes from, and under a timing-only feature (jitter) its calm twin."""
        deps = [self.reference()] if self.reference() != self else []
        deps += self.noise_probes()
        if self.impl != REFERENCE_IMPL and (self.world_size > 1 or self.resume_from > 0):
            deps.append(self.ws1())
        deps += [self.calm()] if self.calm() is not None else []
        return deps + ([self.saver()] if self.saver() is not None else [])

    def calm(self) -> Scenario | None:
        """Under a timing-only feature (jitter): the same run without it, which this one must equal bitwise at
        every step (harness/checks/features.py jitter_invariant); None otherwise."""
        if not any(has(self.feature, f) for f in TIMING_ONLY):
            return None
        return dataclasses.replace(self, feature=without(self.feature, *TIMING_ONLY))

    def ws1(self) -> Scenario:
        """The same implementation at world size 1, same data mode and feature (less a timing-only one: its
        run is held to its calm twin, which is held to this one): the cross-world-size comparison; for a
        resumed run, the uninterrupted plain run (what it must go on like)."""
        if has(self.feature, "ckpt"):
            return dataclasses.replace(
                self, world_size=1, feature=without(self.feature, "ckpt", *TIMING_ONLY), resume_from=0
            )
        return dataclasses.replace(self, world_size=1, feature=without(self.feature, *TIMING_ONLY))

    def factor_twin(self) -> Scenario | None:
        """Split data with k micro-batches at W: the same implementation's step at W x k ranks (the same
        composition without its micro-batches, from scratch)
        trains on the same global batch in W x k pieces of the same size (grouped otherwise: a rank's
        micro-batches are contiguous pieces of its strided slice), so the two factorisations must agree
        within rounding. None otherwise."""
        k = passes_per_step(self.feature)
        if self.data_mode != "split" or k == 1 or self.impl == REFERENCE_IMPL:
            return None
        return dataclasses.replace(
            self,
            world_size=self.world_size * k,
            feature=without(self.feature, "accum", "no_sync", "ckpt", *TIMING_ONLY),
            resume_from=0,
        )

    def at_world_size(self, world_size: int) -> Scenario:
        return dataclasses.replace(self, world_size=world_size)

    def replace(self, **changes) -> Scenario:
        return dataclasses.replace(self, **changes)


def scenario_id(
    impl: str,
    model: str,
    world_size: int,
    data_mode: str,
    optimizer: str | None = None,
    seed: int = 0,
    feature: str = "plain",
    resume_from: int = 0,
    micro_batches: int = 1,
    reverse_micro: bool = False,
    nudge: int = 0,
) -> str:
    """The one way ids are made: ``impl-model-wsW-mode[-optimizer][-feature][-fromW][-microK][-nudgeN][-seedN]``.
    Runs that train no optimizer (the per-sample norms, measured on one backward) leave it out; the plain
    feature is left out; ``-fromW`` names the world size a resumed (ckpt) run's checkpoint was saved at,
    ``-microK`` the micro-batches a reference sums (Scenario.micro_batches), ``-microKrev`` in reverse order,
    ``-nudgeN`` a probe's clipping coefficient nudged by N ulps (Scenario.nudge)."""
    parts = [_slug(impl), _slug(model), f"ws{world_size}", data_mode] + ([_slug(optimizer)] if optimizer else [])
    parts += [feature] if feature != "plain" else []
    parts += [f"from{resume_from}"] if resume_from else []
    parts += [f"micro{micro_batches}{'rev' if reverse_micro else ''}"] if micro_batches > 1 else []
    parts += [f"nudge{nudge}"] if nudge else []
    return "-".join(parts) + (f"-seed{seed}" if seed else "")


def user_optimizer(name: str) -> bool:
    """A user's optimizer factory ``"package.module:factory"`` (harness/optimizers.py), not a built-in."""
    return name not in OPTIMIZERS and ":" in name


def _slug(impl: str) -> str:
    """A user adapter, model or optimizer 'pkg.mod:obj' becomes 'pkg.mod.obj' so ids stay path- and shell-safe."""
    return impl.replace(":", ".").replace("/", ".")


def build_matrix(
    impls,
    models,
    world_sizes,
    data_modes,
    optimizers,
    *,
    steps=10,
    seeds=(0,),
    lr=1e-2,
    global_batch=16,
    backend="gloo",
    features=("plain",),
) -> list[Scenario]:
    """Every combination, in a stable order, plus the runs they are compared with: the references
    first, and each implementation at world size 1 where the world sizes leave it out. A ckpt cell
    at W is one per other world size of the run that its checkpoint comes from (W itself when the
    run has one world size)."""
    cells = [
        Scenario(
            impl,
            model,
            ws,
            mode,
            opt,
            steps=steps,
            seed=seed,
            lr=lr,
            global_batch=global_batch,
            backend=backend,
            feature=feature,
            resume_from=source,
        )
        for seed, feature, impl, model, ws, mode, opt in itertools.product(
            seeds, features, impls, models, world_sizes, data_modes, optimizers
        )
        for source in _sources(feature, ws, world_sizes)
    ]
    return with_dependencies(cells)


def _sources(feature: str, world_size: int, world_sizes) -> list[int]:
    """resume_from values of a cell: every other world size of the run for ckpt, else none (0)."""
    if not has(feature, "ckpt"):
        return [0]
    return [w for w in world_sizes if w != world_size] or [world_size]


def with_dependencies(cells: list[Scenario]) -> list[Scenario]:
    """`cells` plus every run they depend on (`Scenario.dependencies`, and theirs), references first."""
    have = set(cells)
    deps, todo = set(), list(cells)
    while todo:
        for d in todo.pop().dependencies():
            if d not in have and d not in deps:
                deps.add(d)
                todo.append(d)
    refs = sorted((d for d in deps if d.impl == REFERENCE_IMPL), key=lambda s: s.id)
    ws1 = sorted((d for d in deps if d.impl != REFERENCE_IMPL), key=lambda s: s.id)
    return refs + ws1 + cells
