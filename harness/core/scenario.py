"""Frozen scenarios: one cell of the (impl x model x world size x data mode x optimizer x feature) matrix."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

DATA_MODES = ("replicated", "split")
OPTIMIZERS = ("adamw", "sgd")
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
FEATURES = ("plain", "accum", "no_sync", "clip", "clip_inf", "ac")
ACCUM_MICRO_BATCHES = 2
# feature -> (norm type, max norm): below the smallest pre-clip norm the default models reach in 10
# steps under seeds 0-4 (L2 0.20, inf 0.033 on mlp), so clipping acts at every step (checked per run)
CLIP = {"clip": (2.0, 0.1), "clip_inf": (float("inf"), 0.01)}
# features that must leave every number bitwise as the plain step has it: compared with the plain reference
NUMBERS_UNCHANGED = ("ac",)
# the adapter method a feature needs beyond the protocol's required ones (harness/adapters/base.py)
FEATURE_NEEDS = {"no_sync": "set_gradient_sync", "clip": "clip_grad_norm", "clip_inf": "clip_grad_norm"}


def feature_of(row) -> str:
    """A table row's feature; a row stored before features existed (no column, or empty) is plain."""
    feature = getattr(row, "feature", "plain")
    return feature if isinstance(feature, str) and feature else "plain"


def passes_per_step(feature: str) -> int:
    """Forward and backward passes in one training step: each gathers the parameters."""
    return ACCUM_MICRO_BATCHES if feature in ("accum", "no_sync") else 1


def reductions_per_step(feature: str) -> int:
    """Gradient reductions in one training step."""
    return ACCUM_MICRO_BATCHES if feature == "accum" else 1


def holds_unsharded_grads(feature: str) -> bool:
    """Whether the step keeps every unit's unsharded gradient between passes (no reduction until the last)."""
    return feature == "no_sync"


@dataclass(frozen=True)
class Scenario:
    impl: str  # registry name ("fsdp_impl", "torch_fsdp2", ...) or "package.module:object"
    model: str  # model zoo name ("mlp", "tinylm", ...)
    world_size: int
    data_mode: str  # "replicated": every rank trains on the global batch; "split": 1/W slice each
    optimizer: str  # "adamw" | "sgd" (SGD with momentum)
    steps: int = 10
    seed: int = 0
    lr: float = 1e-2
    global_batch: int = 16
    backend: str = "gloo"  # "gloo" (CPU) | "nccl" (CUDA)
    feature: str = "plain"  # FEATURES

    @property
    def id(self) -> str:
        """Stable readable id, e.g. ``fsdp_impl-mlp-ws4-split-adamw`` (``...-adamw-accum`` with a feature)."""
        return scenario_id(self.impl, self.model, self.world_size, self.data_mode, self.optimizer, self.seed,
                           self.feature)

    @classmethod
    def of_row(cls, row) -> "Scenario":
        """The scenario of a scenarios-table row."""
        return cls(row.impl, row.model, int(row.world_size), row.data_mode, row.optimizer, seed=int(row.seed),
                   feature=feature_of(row))

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def reference(self) -> "Scenario":
        """The scenario whose trajectory this one is compared with: the plain model, full batch, doing
        the same feature (the same micro-batches, ...); for a feature that must not change the numbers
        at all (NUMBERS_UNCHANGED: activation checkpointing), the plain model doing the plain step."""
        feature = "plain" if self.feature in NUMBERS_UNCHANGED else self.feature
        return dataclasses.replace(self, impl=REFERENCE_IMPL, world_size=1, data_mode="replicated", feature=feature)

    def dependencies(self) -> list["Scenario"]:
        """The runs this one's checks compare with: the reference and, for a sharded run at W > 1,
        the same implementation at world size 1 in the same data mode."""
        deps = [] if self.impl == REFERENCE_IMPL else [self.reference()]
        if self.impl != REFERENCE_IMPL and self.world_size > 1:
            deps.append(self.at_world_size(1))
        return deps

    def at_world_size(self, world_size: int) -> "Scenario":
        return dataclasses.replace(self, world_size=world_size)

    def replace(self, **changes) -> "Scenario":
        return dataclasses.replace(self, **changes)


def scenario_id(impl: str, model: str, world_size: int, data_mode: str, optimizer: str | None = None,
                seed: int = 0, feature: str = "plain") -> str:
    """The one way ids are made: ``impl-model-wsW-mode[-optimizer][-feature][-seedN]``. Runs that train no
    optimizer (the per-sample norms, measured on one backward) leave it out; the plain feature is left out."""
    parts = [_slug(impl), _slug(model), f"ws{world_size}", data_mode] + ([optimizer] if optimizer else [])
    parts += [feature] if feature != "plain" else []
    return "-".join(parts) + (f"-seed{seed}" if seed else "")


def _slug(impl: str) -> str:
    """A user adapter or model 'pkg.mod:obj' becomes 'pkg.mod.obj' so ids stay path- and shell-safe."""
    return impl.replace(":", ".").replace("/", ".")


def build_matrix(
    impls, models, world_sizes, data_modes, optimizers, *, steps=10, seeds=(0,), lr=1e-2,
    global_batch=16, backend="gloo", features=("plain",),
) -> list[Scenario]:
    """Every combination, in a stable order, plus the runs they are compared with: the references
    first, and each implementation at world size 1 where the world sizes leave it out."""
    cells = [
        Scenario(impl, model, ws, mode, opt, steps=steps, seed=seed, lr=lr,
                 global_batch=global_batch, backend=backend, feature=feature)
        for seed, feature, impl, model, ws, mode, opt in itertools.product(
            seeds, features, impls, models, world_sizes, data_modes, optimizers)
    ]
    return with_dependencies(cells)


def with_dependencies(cells: list[Scenario]) -> list[Scenario]:
    """`cells` plus every run they depend on (`Scenario.dependencies`), references first."""
    have = set(cells)
    deps = {d for c in cells for d in c.dependencies() if d not in have}
    refs = sorted((d for d in deps if d.impl == REFERENCE_IMPL), key=lambda s: s.id)
    ws1 = sorted((d for d in deps if d.impl != REFERENCE_IMPL), key=lambda s: s.id)
    return refs + ws1 + cells
