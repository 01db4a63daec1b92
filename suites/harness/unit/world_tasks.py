"""Task functions that suites/harness/unit/test_world.py runs inside world workers."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from harness.execute.world import RankContext


def whoami(ctx: RankContext, payload: object) -> dict:
    """The rank's view of itself, plus the payload echoed back."""
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "pid": os.getpid(),
        "device": str(ctx.device),
        "backend": ctx.backend,
        "payload": payload,
        "threads": torch.get_num_threads(),
        "omp_env": os.environ.get("OMP_NUM_THREADS"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def all_reduce_sum(ctx: RankContext, offset: float) -> list[float]:
    """Each rank contributes [rank + offset, 1]; every rank returns the summed tensor."""
    t = torch.tensor([ctx.rank + offset, 1.0], device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    return t.tolist()


def raise_on_rank(ctx: RankContext, bad_rank: int) -> int:
    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    return ctx.rank


def exit_on_rank(ctx: RankContext, dead_rank: int) -> int:
    """``dead_rank`` leaves without a word, as a crash would."""
    if ctx.rank == dead_rank:
        os._exit(7)
    return ctx.rank


def hang_on_rank(ctx: RankContext, stuck_rank: int) -> int:
    """``stuck_rank`` enters a collective that every other rank skips: it waits forever."""
    if ctx.rank == stuck_rank:
        dist.all_reduce(torch.ones(1), group=ctx.group)
    return ctx.rank


def sleep(ctx: RankContext, seconds: float) -> int:
    """Every rank blocks on its own: no peer's death can wake it."""
    time.sleep(seconds)
    return ctx.rank


def unpicklable(ctx: RankContext, payload: object) -> object:
    return lambda: None


def temp_dir_full(ctx: RankContext, payload: object) -> None:
    """A write into the run's temp dir that finds the disk full (harness.core.scratch)."""
    import errno
    import os
    import tempfile

    from harness.core.scratch import writing_into

    with writing_into(tempfile.gettempdir()):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def gc_state(ctx: RankContext, _payload: object) -> dict:
    """What the collector holds in this worker: frozen objects, and those it would walk."""
    import gc

    return {"frozen": gc.get_freeze_count(), "walked": len(gc.get_objects())}


def settled_figures(ctx: RankContext, payload: dict) -> list[dict]:
    """harness.train.records.StepFigures on this rank: two steps of made-up figures (rank r's loss 1 + r + step,
    squared norm (r + 1) x step, eval loss 10 + r), settled; the records every rank ends with."""
    from harness.train.records import StepFigures

    figures = StepFigures(ctx, split=payload["split"], adds_up=payload["adds_up"])
    records = [{"step": k} for k in (1, 2)]
    for k, record in zip((1, 2), records):
        figures.add(record, 1.0 + ctx.rank + k, float((ctx.rank + 1) * k), 10.0 + ctx.rank)
    figures.settle()
    return records


def gradient_digest(ctx: RankContext, payload: dict) -> None:
    """Each rank's values into step 1's digest in payload["folder"]: rank r holds r + 1, r + 2, 0 (the zero left out)."""
    from pathlib import Path

    from harness.train.records import write_gradient_digest

    values = torch.tensor([ctx.rank + 2.0, 0.0, ctx.rank + 1.0])
    write_gradient_digest(values, ctx, Path(payload["folder"]), 1, payload["own_part"])


def replace_linear(ctx: RankContext, payload: object) -> bool:
    """Replaces torch.nn.functional.linear for the process, as DeepSpeed's ZeRO-3 does; True once done."""
    import torch.nn.functional as F

    F.linear = lambda *args, **kwargs: None
    return True


def linear_is_torchs(ctx: RankContext, payload: object) -> bool:
    import torch
    import torch.nn.functional as F

    return F.linear is torch._C._nn.linear
