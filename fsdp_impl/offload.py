"""CPUOffloadPolicy: a unit's sharded state lives in host memory; the device holds only what a step gathers.

With ``fully_shard(module, offload_policy=CPUOffloadPolicy())`` every sharded parameter, its gradient and
so the optimizer's state (made by the optimizer like its parameter) live on the CPU between steps, as with
FSDP2's policy of the same name. Forward and backward still run on the device the module was on when it
was sharded:

    unshard       each shard is copied host -> device into the all-gather's send buffer (one copy, no
                  extra device buffer), then gathered as usual
    reduce_grads  the gradient is reduced on the device as usual; this rank's reduced chunk is copied
                  device -> host and becomes (or is added to) the sharded gradient there
    step          the optimizer steps the host shards on the CPU

Numbers: every value that crosses is copied, never computed on, so forward and backward are the device's
arithmetic and the optimizer step is the CPU's. A plain model is bitwise this at one rank only when its
optimizer also steps on the CPU (the device's and the CPU's optimizer kernels may round differently).

On a CPU-only process (gloo) host and device are the same memory: the policy changes nothing but is
accepted, so code written for a GPU job runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """`pin_memory`: host shards in page-locked memory, so host <-> device copies are direct DMA (taken
    only where CUDA is there to pin for)."""

    pin_memory: bool = True

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` moved to host memory (pinned where asked and possible); `t` itself when already there and
        nothing is to be pinned."""
        pin = self.pin_memory and torch.cuda.is_available()
        if t.device.type == "cpu" and (not pin or t.is_pinned()):
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        out.copy_(t)
        return out
