"""Stanford CS336 assignment 2 FSDP, through its test adapter functions (``tests/adapters.py``
of stanford-cs336/assignment2-systems)::

    get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module
    fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None
    fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, Tensor]   # non-parallel names

Name it ``cs336:<module>`` (e.g. ``cs336:tests.adapters``), optionally ``cs336:<module>@bf16``
for a compute dtype. The student's FSDP chooses its own units (``units`` is ignored) and shards
over the DEFAULT process group, so the harness group must span the whole world.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.adapters.base import Adapter, AdapterError, cpu_fp32
from harness.adapters.user import import_module

FUNCTIONS = ("get_fsdp", "fsdp_on_after_backward", "fsdp_gather_full_params")
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


class CS336Adapter(Adapter):
    def __init__(self, module: str, compute_dtype: torch.dtype | None = None) -> None:
        self.name = f"cs336:{module}"
        self.compute_dtype = compute_dtype
        self.module = import_module(module, self.name)
        for fn in FUNCTIONS:
            if not callable(getattr(self.module, fn, None)):
                raise AdapterError(
                    f"adapter {self.name!r}: module {module!r} has no {fn}() (required: {', '.join(FUNCTIONS)})"
                )

    @classmethod
    def from_name(cls, name: str) -> CS336Adapter:
        """``cs336:<module>`` or ``cs336:<module>@<dtype>``."""
        module, _, dtype = name.removeprefix("cs336:").partition("@")
        if not module:
            raise AdapterError(f"adapter {name!r}: expected 'cs336:<module>[@bf16|fp16|fp32]'")
        if dtype and dtype not in DTYPES:
            raise AdapterError(f"adapter {name!r}: unknown compute dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        return cls(module, DTYPES[dtype] if dtype else None)

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        if dist.is_initialized() and dist.get_world_size(group) != dist.get_world_size():
            raise AdapterError(
                f"adapter {self.name!r}: CS336 FSDP shards over the default process "
                f"group, but the harness group has {dist.get_world_size(group)} of "
                f"{dist.get_world_size()} ranks"
            )
        model.to(device)
        if self.compute_dtype is None:
            return self.module.get_fsdp(model)
        if "compute_dtype" not in inspect.signature(self.module.get_fsdp).parameters:
            raise AdapterError(f"adapter {self.name!r}: get_fsdp() takes no compute_dtype argument")
        return self.module.get_fsdp(model, compute_dtype=self.compute_dtype)

    def after_backward(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module.fsdp_on_after_backward(wrapped, optimizer)

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        full = self.module.fsdp_gather_full_params(wrapped)
        if full and all(k.startswith("module.") for k in full):  # wrapper's names, not the model's
            full = {k.removeprefix("module."): v for k, v in full.items()}
        return {name: cpu_fp32(t) for name, t in full.items()}
