"""PyTorch FSDP1 (``FullyShardedDataParallel``, FULL_SHARD, ``use_orig_params=True``), each unit
auto-wrapped. On CPU, torch 2.13 FSDP1 refuses to start ("FSDP needs a non-CPU accelerator
device") unless ``device_id=torch.device("cpu")`` is passed, so it is passed explicitly."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from harness.adapters.base import Adapter, cpu_fp32, strip_prefixes

_WRAPPER = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class TorchFSDP1Adapter(Adapter):
    name = "torch_fsdp1"

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import CustomPolicy

        device = torch.device(device)
        unit_ids = {id(u) for u in units}
        return FSDP(
            model.to(device),
            process_group=group,
            auto_wrap_policy=CustomPolicy(lambda m: id(m) in unit_ids),
            device_id=device,
            use_orig_params=True,
        )

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(wrapped, writeback=False, rank0_only=False):
            return {strip_prefixes(n, _WRAPPER): cpu_fp32(p) for n, p in wrapped.named_parameters()}
