"""Per-rank measurement for any data-parallel implementation: collectives and their bytes
(`CommCounter`), training state held (`state_bytes`), peak memory by category over a step
(`PeakMemory`) and the ZeRO-3 ideals they are compared with (`harness.measure.ideals`, torch-free). The memory
planner for large world sizes, which builds models and wraps them, is harness.plan's.

The names are loaded on first use: the process that only judges a run needs the ideals, not the rank
side's torch.distributed imports, a cost to every CLI and pytest start (reports/performance.md#imports)."""

from __future__ import annotations

import importlib

_WHERE = {
    "CommCounter": "comm",
    "state_bytes": "memory",
    "PeakMemory": "memory",
    "CATEGORIES": "memory",
    "ideal_state_bytes": "ideals",
    "ideal_comm_elements": "ideals",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'harness.measure' has no attribute {name!r}")
    return getattr(importlib.import_module(f"harness.measure.{_WHERE[name]}"), name)
