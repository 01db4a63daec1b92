"""Per-rank measurement for any data-parallel implementation: collectives and their bytes
(`CommCounter`), training state held (`state_bytes`), peak memory by category over a step
(`PeakMemory`), the ZeRO-3 ideals they are compared with, and a one-process memory planner
for large world sizes (`harness.measure.plan.plan_memory`, imported on demand)."""

from harness.measure.comm import CommCounter, ideal_comm_elements
from harness.measure.memory import CATEGORIES, PeakMemory, ideal_state_bytes, state_bytes

__all__ = ["CommCounter", "state_bytes", "PeakMemory", "ideal_state_bytes", "ideal_comm_elements",
           "CATEGORIES"]
