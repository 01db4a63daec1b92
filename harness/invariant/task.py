"""The world task of the batch-invariant tier: one implementation trained through its own batch-invariant step
(the adapter's ``invariant_forward_backward``), the full parameters and the loss recorded after every step.

Every rank returns its losses; rank 0 also returns the full parameters after each step (fp32, CPU), as the
adapter's ``full_params`` gives them (collective). The batch of step s is the zoo model's seeded batch of the
global size, cut as the data mode cuts it: rank r's contiguous 1 / W with split data, the whole batch on every
rank with replicated data (harness.train.data.local_slice's contiguous layout is not assumed: the cut is here,
contiguous, because the invariant mode's micro-batch index runs over contiguous slices).
"""

from __future__ import annotations

import torch

from harness.adapters import load_adapter
from harness.train.models import get_model_spec


def train_invariant(ctx, p: dict) -> dict:
    """`p`: impl, model, optimizer, data_mode, micro (L), steps, seed, lr, global_batch."""
    adapter = load_adapter(p["impl"])
    if not callable(getattr(adapter, "invariant_forward_backward", None)):
        return {"unsupported": f"adapter '{adapter.name}' has no invariant_forward_backward() method, which the "
                               f"batch-invariant tier needs (see harness/adapters/base.py)"}
    spec = get_model_spec(p["model"])
    torch.manual_seed(p["seed"])
    model = spec.build()
    wrapped = adapter.wrap(model, spec.units(model), group=ctx.group, device=ctx.device)
    optimizer = adapter.make_optimizer(wrapped, name=p["optimizer"], lr=p["lr"])
    replicated = p["data_mode"] == "replicated"
    losses, params = [], []
    for step in range(1, p["steps"] + 1):
        x, y = spec.make_batch(p["global_batch"], step, p["seed"])
        if not replicated:
            n = x.shape[0] // ctx.world_size
            x, y = x[ctx.rank * n:(ctx.rank + 1) * n], y[ctx.rank * n:(ctx.rank + 1) * n]
        x, y = x.to(ctx.device), y.to(ctx.device)
        loss = adapter.invariant_forward_backward(wrapped, spec.loss, x, y, micro_batches=p["micro"],
                                                  replicated=replicated)
        adapter.after_backward(wrapped, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        full = adapter.full_params(wrapped)  # collective: every rank calls it
        if ctx.rank == 0:
            params.append({k: v.detach().to("cpu", torch.float32).clone() for k, v in full.items()})
    return {"losses": losses, "params": params}
