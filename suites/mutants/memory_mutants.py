"""Mutants that change memory only, not the numbers: full parameters kept after forward (every
forward, or only a forward under torch.no_grad()), optimizer state for the whole parameter on every rank.
"""

from __future__ import annotations

import torch

from suites.mutants.injection import MutantAdapter, sharded_params_of, unit_states_of


class ReshardSkipped(MutantAdapter):
    """No reshard after forward: every unit keeps its full parameters from its forward until its
    backward (the numbers are unchanged, peak memory holds all units unsharded at once)."""

    name = "mutant:reshard_skipped"

    def mutate(self, wrapped):
        for _, state in unit_states_of(wrapped):
            state.reshard_after_forward = False


class NoGradForwardUnsharded(MutantAdapter):
    """The reshard after forward skipped when the forward ran under torch.no_grad(), as if the
    post-backward would reshard (none comes: no graph was built), the class of pytorch #149029: every
    unit stays gathered after an evaluation forward until the next training step's backward reshards
    it. A training forward (grad enabled) is left as the product has it, so the numbers are unchanged
    and only a no_grad forward shows it. Injected into each unit's registered post-forward hook: the
    product's own hook runs, with that unit's reshard a no-op while grad is disabled."""

    name = "mutant:no_grad_forward_unsharded"

    def mutate(self, wrapped):
        import torch

        for _, state in unit_states_of(wrapped):
            hooks = state.module._forward_hooks
            key = next(k for k, h in hooks.items() if h == state._post_forward)

            def post_forward(module, args, output, state=state, product=hooks[key]):
                if torch.is_grad_enabled():
                    return product(module, args, output)
                state.params.reshard = lambda: None  # this unit's own ParamGroup, for this call only
                try:
                    return product(module, args, output)
                finally:
                    del state.params.reshard

            hooks[key] = post_forward


class OptimizerStateUnsharded(MutantAdapter):
    """Optimizer state kept for the whole parameter on every rank (as an optimizer built over the
    unsharded parameters): each rank's exp_avg / exp_avg_sq / momentum buffer is a DTensor whose
    local rows are a view of a full padded buffer (W x c rows) of which it updates its own rows, so
    the numbers are unchanged and the state is W x."""

    name = "mutant:optimizer_state_unsharded"

    def make_optimizer(self, wrapped, *, name, lr):
        opt = super().make_optimizer(wrapped, name=name, lr=lr)
        keys = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}[name]
        for _, p in sharded_params_of(wrapped):
            if not p.requires_grad:
                continue
            lo = p.rank * p.shard_numel
            state = {
                k: p.to_dtensor(
                    torch.zeros(p.world_size * p.shard_numel, dtype=p.dtype, device=p.device)[
                        lo : lo + p.local_numel
                    ].view(p.local_shape)
                )
                for k in keys
            }
            if name == "adamw":
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            opt.state[p.sharded] = state
        return opt
