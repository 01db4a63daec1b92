"""Adapters: how each FSDP/ZeRO-3 implementation is wrapped, stepped and read back.

``load_adapter(name)`` accepts a built-in name, ``"cs336:<module>"`` for a Stanford CS336
assignment-2 adapter module, or ``"package.module:object"`` for a user adapter (see base.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.adapters.base import Adapter, AdapterError, as_adapter
from harness.adapters.cs336 import CS336Adapter
from harness.adapters.ddp import DDPAdapter
from harness.adapters.deepspeed import DeepSpeedAdapter
from harness.adapters.fsdp_impl import FsdpImplAdapter
from harness.adapters.reference import ReferenceAdapter
from harness.adapters.torch_fsdp1 import TorchFSDP1Adapter
from harness.adapters.torch_fsdp2 import TorchFSDP2Adapter
from harness.adapters.user import load_user_adapter
from harness.core.names import unknown_adapter

BUILTINS: dict[str, Callable[[], Adapter]] = {
    "reference": ReferenceAdapter,
    "fsdp_impl": FsdpImplAdapter,
    "torch_fsdp2": TorchFSDP2Adapter,
    "torch_fsdp2_fp64reduce": lambda: TorchFSDP2Adapter(reduce_dtype=torch.float64),
    "torch_fsdp1": TorchFSDP1Adapter,
    "ddp": DDPAdapter,
    "deepspeed_zero1": lambda: DeepSpeedAdapter(1),
    "deepspeed_zero2": lambda: DeepSpeedAdapter(2),
    "deepspeed_zero3": lambda: DeepSpeedAdapter(3),
}


def load_adapter(name: str) -> Adapter:
    """A fresh adapter for `name`; AdapterError (one line) if it cannot be had."""
    if name in BUILTINS:
        return BUILTINS[name]()
    if name.startswith("cs336:"):
        return CS336Adapter.from_name(name)
    if ":" in name:
        return load_user_adapter(name)
    raise AdapterError(unknown_adapter(name))


__all__ = ["Adapter", "AdapterError", "BUILTINS", "as_adapter", "load_adapter"]
