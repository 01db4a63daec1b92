"""Memory-only scaling plans for large models, by implementation name (`python -m harness plan`).

One process, PyTorch's fake process group, the model built on the meta device: per-rank state
(params, grads, optimizer state) at world sizes far beyond this machine, against the ZeRO-3
ideal. See harness/plan/memory.py for what is and is not measured.
"""

from __future__ import annotations

import pandas as pd
import torch

from harness.adapters import load_adapter
from harness.plan.memory import fsdp2_wrap, plan_memory
from harness.train.models import get_model_spec


class PlanError(ValueError):
    """An implementation the planner cannot plan (its wrap fails on the meta device, under the fake process
    group); the message is one line naming it and the error."""


def _wrapper(impl: str, units):
    if impl.startswith("torch_fsdp2"):
        # the adapter moves the model to a real device first; on meta the wrap must not
        return lambda m, g: fsdp2_wrap(m, g, "cpu", units=units)
    adapter = load_adapter(impl)
    return lambda m, g: adapter.wrap(m, units(m), group=g, device=torch.device("meta"))


def plan_table(model: str, impls, world_sizes, optimizer: str = "adamw") -> pd.DataFrame:
    spec = get_model_spec(model)
    rows = []
    for impl in impls:
        try:
            planned = plan_memory(spec.build, _wrapper(impl, spec.units), list(world_sizes), optimizer)
        except Exception as e:  # an implementation's own code on meta tensors may raise anything
            from harness.core.loading import one_line

            raise PlanError(
                f"--impl {impl}: the planner cannot plan it: sharding {model} on the meta device under a fake process "
                f"group raised {one_line(e)}"
            ) from e
        for r in planned:
            if r["world_size"] not in world_sizes:
                continue
            rows.append(
                {
                    "impl": impl,
                    "world_size": r["world_size"],
                    "params": r["params"],
                    "grads": r["grads"],
                    "optimizer_state": r["optimizer_state"],
                    "state_total": r["state_total"],
                    "ideal_state_total": r["ideal_state_total"],
                    "vs_ideal": r["state_total"] / r["ideal_state_total"],
                    "reduction": r["reduction"],
                    "seconds": r["seconds"],
                    "note": r["note"],
                }
            )
    return pd.DataFrame(rows)


def format_plan(df: pd.DataFrame) -> str:
    show = df.copy()
    for col in ("params", "grads", "optimizer_state", "state_total", "ideal_state_total"):
        show[col] = show[col].map(lambda b: f"{b / 2**20:,.1f} MiB")
    show["vs_ideal"] = show["vs_ideal"].map(lambda x: f"{x:.4f}")
    show["reduction"] = show["reduction"].map(lambda x: f"{x:.2f}x")
    show["seconds"] = show["seconds"].map(lambda x: f"{x:.1f}")
    return show.to_markdown(index=False, disable_numparse=True)
