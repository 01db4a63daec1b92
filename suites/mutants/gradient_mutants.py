"""Mutants that get the gradient wrong: its scale (summed, averaged twice, counted per tie
owner, never cleared), its precision (reduced in bf16), or which parameters get one (frozen ones).

``frozen_probe_task`` checks ``frozen_updated`` directly, outside the harness checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from suites.mutants.injection import (
    MutantAdapter,
    ReductionReplaced,
    around,
    param_groups_of,
    sharded_params_of,
    unit_states_of,
)


class GradSummed(ReductionReplaced):
    """Gradients summed over ranks, not averaged (the division by W is missing)."""

    name = "mutant:grad_summed"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return mean(full_grad, group, reduce_dtype).mul_(dist.get_world_size(group))


class AveragedTwice(ReductionReplaced):
    """Gradients divided by W twice (e.g. the loss pre-divided by W and the reduction averaging too)."""

    name = "mutant:averaged_twice"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return mean(full_grad, group, reduce_dtype).div_(dist.get_world_size(group))


class LastRankNegated(ReductionReplaced):
    """One rank's reduced gradient comes back with its sign flipped (a fault in one rank's path only): the
    last rank of two or more steps its own rows the wrong way; the other ranks' rows are right."""

    name = "mutant:last_rank_negated"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        shard = mean(full_grad, group, reduce_dtype)
        w = dist.get_world_size(group)
        return shard.neg_() if w > 1 and dist.get_rank(group) == w - 1 else shard


class LastRankScaledInput(ReductionReplaced):
    """The last rank's gradient is doubled before it enters the reduction (one rank's local gradient wrong:
    its loss scaled twice, say). After the mean every rank's shard is wrong alike, so the rows say nothing
    of the rank; what each rank puts into the reduction does."""

    name = "mutant:last_rank_scaled_input"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        w = dist.get_world_size(group)
        return mean(full_grad * 2 if w > 1 and dist.get_rank(group) == w - 1 else full_grad, group, reduce_dtype)


class LowPrecisionReduce(ReductionReplaced):
    """Gradients reduced in bf16 although the policy says fp32 params / fp64 reduce: the gradient is
    cast to bf16 before the exchange (half the bytes) and summed in bf16."""

    name = "mutant:bf16_reduce"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return mean(full_grad.to(torch.bfloat16), group, torch.bfloat16)


class Fp32Reduce(ReductionReplaced):
    """Gradients summed in fp32 in rank order (the policy says fp64): W identical addends round at
    the partial sums 3g, 5g, 6g, 7g, so the averaged gradient is off by an ulp in places."""

    name = "mutant:fp32_reduce"

    def reduce(self, mean, full_grad, group, reduce_dtype):
        return mean(full_grad, group, torch.float32)


class TiedReducedTwice(MutantAdapter):
    """A tied parameter's gradient counted once per owner (embedding and head each reduce the
    parameter's accumulated gradient), so it is doubled: its unsharded gradient is scaled by the
    number of owners before the unit's reduction."""

    name = "mutant:tied_reduced_twice"

    def mutate(self, wrapped):
        for _, g in param_groups_of(wrapped):
            tied = [p for p in g.params if len(p.owners) > 1]
            if not tied:
                continue

            def reduce_per_owner(product, tied=tied):
                for p in tied:
                    if p.unsharded_grad() is not None:
                        p.unsharded.grad.mul_(len(p.owners))
                return product()

            around(g, "reduce_grads", reduce_per_owner)


class GradsNotCleared(MutantAdapter):
    """The unsharded gradient is never released: after a backward, each unsharded parameter keeps the
    gradient it reduced, autograd adds the next step's gradient to it, so step k reduces the sum of
    steps 1..k (``optimizer.zero_grad`` clears only the sharded .grad). Every world size, W = 1
    included: its gradient too reaches the sharded parameter through the unsharded one and the
    reduction. (The gradient is put back at the end of the backward, the unit's final callback: one
    reduction per backward, as in the product.)"""

    name = "mutant:grads_not_cleared"

    def mutate(self, wrapped):
        for _, state in unit_states_of(wrapped):
            g = state.params
            if not g.params:
                continue
            kept: dict = {}  # id(ShardedParam) -> the gradient it reduced in this backward

            def reduce_and_keep(product, g=g, kept=kept):
                kept.update(
                    {id(p): p.unsharded.grad.detach().clone() for p in g.params if p.unsharded_grad() is not None}
                )
                product()

            def end_of_backward(product, g=g, kept=kept):
                product()
                for p in g.params:
                    if id(p) in kept:
                        p.unsharded.grad = kept.pop(id(p))

            around(g, "reduce_grads", reduce_and_keep)
            around(state, "_final_callback", end_of_backward)  # queued by the pre-backward hook


class FrozenUpdated(MutantAdapter):
    """Frozen parameters get gradients and are updated: the requires_grad=False parameters are
    treated as trainable (their unsharded parameter requires grad, their gradient is reduced into
    the sharded .grad, and the optimizer, which lists every parameter, steps them)."""

    name = "mutant:frozen_updated"

    def mutate(self, wrapped):
        for _, p in sharded_params_of(wrapped):
            if not p.requires_grad:
                p.requires_grad = True  # read when the unsharded parameter is made (the first unshard)
                p.sharded.requires_grad_(True)


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


class GradOverwritten(MutantAdapter):
    """The reduced gradient is written over the sharded parameter's ``.grad`` instead of added to it:
    whatever an earlier backward of the same step left there (gradient accumulation) is lost."""

    name = "mutant:grad_overwritten"

    def mutate(self, wrapped):
        for _, p in sharded_params_of(wrapped):

            def overwrite(product, padded_grad, p=p):
                p.sharded.grad = None  # forget what earlier micro-batches reduced
                product(padded_grad)

            around(p, "add_reduced_grad", overwrite)
