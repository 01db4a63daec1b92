"""World tasks for suites/harness/end_to_end/test_cuda.py: fsdp_impl and FSDP2 on one CUDA device, same model, same data.

Each task builds the seeded model on the CPU (so both implementations start from the same bits),
moves it to the rank's device, shards it with the named implementation and a mixed-precision policy,
trains, and returns plain data (losses, dtypes, peak bytes) for the test to compare.
"""

from __future__ import annotations

import torch

from harness.optimizers import make_optimizer
from harness.train.models import get_model_spec

BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _shard(impl: str, model, units, group):
    if impl == "fsdp_impl":
        from fsdp_impl import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(**BF16)
    kwargs = {"mp_policy": policy}
    if impl == "fsdp_impl":
        kwargs["process_group"] = group
    else:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cuda", (group.size(),))
    for unit in units:
        fully_shard(unit, **kwargs)
    return fully_shard(model, **kwargs)


def bf16_training(ctx, p: dict) -> dict:
    """``steps`` AdamW steps of ``model`` under a bf16 compute / fp32 reduce policy."""
    spec = get_model_spec(p["model"])
    torch.manual_seed(0)
    model = spec.build()
    units = spec.units(model)
    model.to(ctx.device)
    model = _shard(p["impl"], model, units, ctx.group)
    opt = make_optimizer(model.parameters(), "adamw", 1e-3)
    out_dtypes: set[str] = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, a, out: out_dtypes.add(str(out.dtype)))
    losses = []
    torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(1, p["steps"] + 1):
        x, y = spec.make_batch(p.get("batch", 8), step, 0)
        loss = spec.loss(model(x.to(ctx.device)).float(), y.to(ctx.device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    torch.cuda.synchronize(ctx.device)
    shards = [q.to_local() if hasattr(q, "to_local") else q for q in model.parameters()]
    return {
        "losses": losses,
        "out_dtypes": sorted(out_dtypes),
        "shard_dtypes": sorted({str(q.dtype) for q in shards}),
        "devices": sorted({q.device.type for q in shards}),
        "peak_bytes": int(torch.cuda.max_memory_allocated(ctx.device)),
    }


class OffloadIgnored:
    """A negative control for the offload check: fsdp_impl whose wrap_offload ignores the policy (the state
    stays on the device), as an implementation that accepts the option and does nothing would."""

    name = "offload_ignored"

    def __new__(cls):
        from dataclasses import replace

        from harness.adapters.base import PLAIN_WRAP
        from harness.adapters.fsdp_impl import FsdpImplAdapter

        class _Ignored(FsdpImplAdapter):
            name = "offload_ignored"

            def wrap(self, model, units, *, group, device, options=PLAIN_WRAP):
                return super().wrap(model, units, group=group, device=device, options=replace(options, offload=False))

        return _Ignored()
