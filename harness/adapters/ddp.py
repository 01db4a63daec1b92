"""PyTorch DistributedDataParallel: a full replica per rank, gradients all-reduced (averaged)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from harness.adapters.base import Adapter, cpu_fp32, torch_clip


class DDPAdapter(Adapter):
    name = "ddp"
    sharded = False  # every rank keeps all parameters and optimizer state

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device = torch.device(device)
        ids = [device] if device.type == "cuda" else None
        # Gradients as views of the communication buckets: otherwise DDP keeps each bucket (a second
        # full copy of the gradients) alive between steps beside the .grad tensors.
        return DistributedDataParallel(
            model.to(device), device_ids=ids, process_group=group, gradient_as_bucket_view=True
        )

    def save_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        """A full checkpoint (every rank holds everything): rank 0 writes it, the others wait."""
        import torch.distributed as dist

        group = wrapped.process_group
        if dist.get_rank(group) == 0:
            tmp = Path(path) / "full.pt.tmp"
            torch.save({"model": wrapped.module.state_dict(), "optim": optimizer.state_dict()}, tmp)
            tmp.replace(Path(path) / "full.pt")
        dist.barrier(group=group)

    def load_checkpoint(self, wrapped: nn.Module, optimizer, path) -> None:
        state = torch.load(Path(path) / "full.pt", weights_only=True, map_location=next(wrapped.parameters()).device)
        wrapped.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    def set_gradient_sync(self, wrapped: nn.Module, enabled: bool) -> None:
        wrapped.require_backward_grad_sync = enabled  # what DDP.no_sync() switches

    def clip_grad_norm(self, wrapped: nn.Module, max_norm: float, norm_type: float) -> float:
        return torch_clip(wrapped.parameters(), max_norm, norm_type)  # every rank holds the whole gradient

    def full_params(self, wrapped: nn.Module) -> dict[str, Tensor]:
        return {name: cpu_fp32(p) for name, p in wrapped.module.named_parameters()}
