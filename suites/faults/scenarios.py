"""The fault scenarios the tests run: ``FA`` names the fault adapters' module
(``suites/faults/fault_adapters.py``), ``scenario`` builds the small cell they run in (mlp,
replicated data, ``STEPS`` steps).
"""

from __future__ import annotations

from harness.core.scenario import Scenario

FA = "suites.faults.fault_adapters"
STEPS = 3


def scenario(impl: str, world_size: int = 2, optimizer: str = "adamw") -> Scenario:
    impl = impl if impl in ("reference", "fsdp_impl") else f"{FA}:{impl}"
    return Scenario(impl, "mlp", world_size, "replicated", optimizer, steps=STEPS)
