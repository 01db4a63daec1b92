"""Mutants that change memory only, not the numbers: full parameters kept after forward,
optimizer state for the whole parameter on every rank.
"""

from __future__ import annotations

import torch

from suites.mutants.injection import MutantAdapter, _params, _units


class ReshardSkipped(MutantAdapter):
    """No reshard after forward: every unit keeps its full parameters from its forward until its
    backward (the numbers are unchanged, peak memory holds all units unsharded at once)."""

    name = "mutant:reshard_skipped"

    def mutate(self, wrapped):
        for _, state in _units(wrapped):
            state.reshard_after_forward = False


class OptimizerStateUnsharded(MutantAdapter):
    """Optimizer state kept for the whole parameter on every rank (as an optimizer built over the
    unsharded parameters): each rank's exp_avg / exp_avg_sq / momentum buffer is a DTensor whose
    local rows are a view of a full padded buffer (W x c rows) of which it updates its own rows, so
    the numbers are unchanged and the state is W x."""

    name = "mutant:optimizer_state_unsharded"

    def make_optimizer(self, wrapped, *, name, lr):
        opt = super().make_optimizer(wrapped, name=name, lr=lr)
        keys = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}[name]
        for _, p in _params(wrapped):
            if not p.requires_grad:
                continue
            lo = p.rank * p.shard_numel
            state = {k: p.to_dtensor(torch.zeros(p.world_size * p.shard_numel, dtype=p.dtype, device=p.device)
                                     [lo:lo + p.local_numel].view(p.local_shape)) for k in keys}
            if name == "adamw":
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            opt.state[p.sharded] = state
        return opt
