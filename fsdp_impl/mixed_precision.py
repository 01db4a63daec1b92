"""Mixed-precision policy, as FSDP2 has it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and gradient reduction; master shards keep the parameters' own dtype.

    param_dtype:  dtype of the gathered (unsharded) parameters used in forward/backward;
                  None keeps the parameters' dtype. Floating inputs of a unit are cast to it.
    reduce_dtype: dtype the gradient shards are summed and averaged in, after an all-to-all
                  exchange in the gradient's own dtype (so the bytes on the wire do not depend
                  on it); None means one step wider than the gradient (fp32 -> fp64,
                  bf16/fp16 -> fp32). The wider, rank-ordered sum makes replicated-data training
                  at any world size bitwise equal to one rank and split-data means correctly
                  rounded. torch.float32 sums in fp32 (cheaper local adds, not exact).
                  Under HSDP the partial sums cross the replicas in reduce_dtype (fp64 by
                  default: twice the bytes of fp32 on the inter-replica links), as exactness needs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
