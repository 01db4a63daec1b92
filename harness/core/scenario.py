"""Frozen scenarios: one cell of the (impl x model x world size x data mode x optimizer x feature) matrix."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from harness.core.features import (
    COMPOSE,
    check_feature,
    has,
    named,
    nudged,
    passes_per_step,
    rounded_per_rank,
    without,
)

DATA_MODES = ("replicated", "split")
OPTIMIZERS = ("adamw", "sgd")  # built in; --optimizers also takes a user's "package.module:factory"
# The plain, non-sharded model trained on the full global batch in one process.
REFERENCE_IMPL = "reference"


def ckpt_step(steps: int) -> int:
    """The step after which a ckpt run's checkpoint is saved (and from which the loading run goes on)."""
    return steps // 2


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
        dropped = named("numbers_unchanged") + (("bf16",) if self.impl == REFERENCE_IMPL else ())
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
        return nudged(self.feature) or user_optimizer(self.optimizer)

    def peak_is_read(self) -> bool:
        """Whether some verdict reads this run's peak memory: an implementation's run (peak_memory_bound,
        peak_params_bound), or a plain-model run that may be another run's yardstick (its reference, or a noise
        probe in rank order: harness.checks.noise_floor.split_yardstick). Not a noise probe in reverse order or
        nudged, which only the numbers' checks read: its measured step runs without the peak tracker."""
        return self.impl != REFERENCE_IMPL or not (self.reverse_micro or self.nudge)

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
        if not any(has(self.feature, f) for f in named("timing_only")):
            return None
        return dataclasses.replace(self, feature=without(self.feature, *named("timing_only")))

    def ws1(self) -> Scenario:
        """The same implementation at world size 1, same data mode and feature (less a timing-only one: its
        run is held to its calm twin, which is held to this one): the cross-world-size comparison; for a
        resumed run, the uninterrupted plain run (what it must go on like)."""
        if has(self.feature, "ckpt"):
            return dataclasses.replace(
                self, world_size=1, feature=without(self.feature, "ckpt", *named("timing_only")), resume_from=0
            )
        return dataclasses.replace(self, world_size=1, feature=without(self.feature, *named("timing_only")))

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
            feature=without(self.feature, "accum", "no_sync", "ckpt", *named("timing_only")),
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
    pieces = [_slug(impl), _slug(model), f"ws{world_size}", data_mode] + ([_slug(optimizer)] if optimizer else [])
    pieces += [feature] if feature != "plain" else []
    pieces += [f"from{resume_from}"] if resume_from else []
    pieces += [f"micro{micro_batches}{'rev' if reverse_micro else ''}"] if micro_batches > 1 else []
    pieces += [f"nudge{nudge}"] if nudge else []
    return "-".join(pieces) + (f"-seed{seed}" if seed else "")


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
