"""Mutants that get the gradient wrong: its scale (summed, averaged twice, counted per tie
owner, never cleared), its precision (reduced in bf16), or which parameters get one (frozen ones).

``frozen_probe_task`` checks ``frozen_updated`` directly, outside the harness checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from suites.mutants.injection import MutantAdapter, ReductionReplaced, _collectives, _handles, _rebind


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
    slot's accumulated gradient), so it is doubled."""

    name = "mutant:tied_reduced_twice"

    def mutate(self, wrapped):
        mean = _collectives().reduce_scatter_mean
        for _, h in _handles(wrapped):
            tied = [(slot, len(owners)) for slot, owners in zip(h.layout.slots, h.owners) if len(owners) > 1]
            if not tied:
                continue

            def reduce_per_owner(full_grad, group, reduce_dtype, tied=tied):
                g = full_grad.clone()
                for slot, n_owners in tied:
                    g[slot.offset:slot.end] *= n_owners
                return mean(g, group, reduce_dtype)

            _rebind(h, "_post_backward", reduce_scatter_mean=reduce_per_owner)


class GradsNotCleared(MutantAdapter):
    """The unsharded gradient is never cleared: autograd adds each step's gradient to the previous
    ones in the full buffer, so step k reduces the sum of steps 1..k (``optimizer.zero_grad``
    clears only the shard's .grad, which hides it at world size 1)."""

    name = "mutant:grads_not_cleared"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            product = h._post_backward  # bound before the first forward registers it as the hook

            def post_backward(full, product=product):
                kept = full.grad.detach().clone()
                product(full)
                full.grad = kept

            h._post_backward = post_backward


class FrozenUpdated(MutantAdapter):
    """Frozen parameters get gradients and are updated: the handle of the requires_grad=False
    group is treated as trainable (its gathered buffer requires grad, its gradient is reduced
    into the shard's .grad, and the optimizer, which lists every shard, steps it)."""

    name = "mutant:frozen_updated"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            if not h.requires_grad:
                h.requires_grad = True


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
    """The reduced gradient is written over the shard's ``.grad`` instead of added to it: whatever an
    earlier backward of the same step left there (gradient accumulation) is lost."""

    name = "mutant:grad_overwritten"

    def mutate(self, wrapped):
        for _, h in _handles(wrapped):
            def post_backward(full, h=h, product=type(h)._post_backward):
                h.shard.grad = None  # forget what earlier micro-batches reduced
                product(h, full)

            h._post_backward = post_backward
