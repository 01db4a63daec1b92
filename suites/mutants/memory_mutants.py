"""Mutants that change memory only, not the numbers: full parameters kept after forward,
optimizer state for the whole flat parameter on every rank.
"""

from __future__ import annotations

import torch

from suites.mutants.injection import MutantAdapter, _handles, _units


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
