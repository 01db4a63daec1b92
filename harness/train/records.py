"""What a rank records of its training beside the step records themselves, and how the run's global figures are
made of the ranks' own, with as little of the harness's traffic between the steps as they allow.

- `StepFigures`: per step a rank holds figures of its own (its loss, the squared norm of its part of the gradient,
  its eval loss); the run's are global (the loss and eval loss of the global batch, the norm of the whole
  gradient). They are settled in batches: one all-gather of every rank's figures for the steps since the last
  settling, at the end of the run and before a checkpoint saves the records, not a collective per step.
- `Snapshots`: the full parameters after every step (the adapter's `full_params`, a collective; gathered to rank 0
  alone where the adapter's full_params takes `rank0_only`), which rank 0 holds and writes in batches, so that it does no
  more between steps than the other ranks do.
- The gradient digest (replicated data): the sorted non-zero gradient values the optimizer applied, a digest no
  layout changes, equal bit for bit exactly when the multisets of values are. Each rank writes its own part
  where the ranks share the run's folder (one machine), else rank 0 gathers them; the parent reads the parts
  together (`read_gradient_digest`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from harness.adapters.base import takes_rank0_only
from harness.train.params_file import load_params, save_params

# rank 0 holds up to this many bytes of snapshots before it writes them
SNAPSHOT_BATCH_BYTES = 128 * 2**20


class StepFigures:
    """This rank's own figures of the steps since the last settling, and the records they settle into."""

    def __init__(self, ctx, *, split: bool, adds_up: bool):
        # split: each rank's loss is its slice's mean; adds_up: the ranks' squared norms are parts of one whole
        self.ctx, self.split, self.adds_up = ctx, split, adds_up
        self.pending: list[tuple[dict, float, float, float]] = []

    def add(self, record: dict, loss: float, grad_sq: float, eval_loss: float) -> None:
        """The step's `record` gets loss, grad_norm and eval_loss when the figures are settled."""
        self.pending.append((record, loss, grad_sq, eval_loss))
        record.update(loss=loss, grad_norm=math.sqrt(grad_sq), eval_loss=eval_loss)  # this rank's, until then

    def settle(self) -> None:
        """Collective (W > 1): every pending record gets the global figures, the same on every rank: the mean of
        the ranks' losses and eval losses with split data (equal slices), else the rank's own (every rank computed
        the same batch: ranks_agree holds them to each other); the sum of the ranks' squared norms where they add
        up, else rank 0's."""
        if not self.pending:
            return
        w = self.ctx.world_size
        mine = torch.tensor([p[1:] for p in self.pending], dtype=torch.float64)
        every = [mine]
        if w > 1:
            mine = mine.to(self.ctx.device)
            every = [torch.empty_like(mine) for _ in range(w)]
            dist.all_gather(every, mine, group=self.ctx.group)
            every = [t.cpu() for t in every]
        for j, (record, loss, grad_sq, eval_loss) in enumerate(self.pending):
            if self.split and w > 1:
                loss = sum(float(t[j, 0]) for t in every) / w
                eval_loss = sum(float(t[j, 2]) for t in every) / w
            grad_sq = sum(float(t[j, 1]) for t in every) if self.adds_up else float(every[0][j, 1])
            record.update(loss=loss, grad_norm=math.sqrt(grad_sq), eval_loss=eval_loss)
        self.pending = []


class Snapshots:
    """The full parameters after each step, rank 0's to write (`<folder>/step<k>.pt`), held until
    SNAPSHOT_BATCH_BYTES of them are, or the run ends (`flush`). A model whose snapshots pass that size is written
    every few steps, and rank 0 then starts the next step late by the write."""

    def __init__(self, ctx, folder: Path):
        self.ctx, self.folder = ctx, folder
        self.held: list[tuple[Path, dict[str, torch.Tensor]]] = []
        self.bytes = 0

    def take(self, adapter, wrapped, step: int) -> None:
        """Collective: the adapter's full parameters now, as step `step`'s snapshot (gathered to rank 0 alone where
        the adapter's full_params takes rank0_only: harness/adapters/base.py)."""
        # every rank calls it
        full = (
            adapter.full_params(wrapped, rank0_only=True) if takes_rank0_only(adapter) else adapter.full_params(wrapped)
        )
        if self.ctx.rank != 0:
            return
        # copies: an adapter may hand out the live parameters (held past this step, they would move on)
        full = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in full.items()}
        self.held.append((self.folder / f"step{step}.pt", full))
        self.bytes += sum(t.numel() * t.element_size() for t in full.values())
        if self.bytes >= SNAPSHOT_BATCH_BYTES:
            self.flush()

    def tensors(self) -> list[torch.Tensor]:
        """The copies held now: the harness's, which no census of the rank's training state may count."""
        return [t for _, full in self.held for t in full.values()]

    def flush(self) -> None:
        for path, full in self.held:
            save_params(full, path)
        self.held, self.bytes = [], 0


DIGEST = "values"  # a digest part's one tensor, in its file (harness.train.params_file)


def digest_name(step: int, rank: int) -> str:
    return f"step{step}.grads.rank{rank}.pt"


def write_gradient_digest(values: torch.Tensor, ctx, folder: Path, step: int, own_part: bool) -> None:
    """This rank's gradient values (flat, fp32, CPU) into step `step`'s digest: its sorted non-zero values in a
    part of its own where `own_part` (the ranks share `folder`), else gathered to rank 0, which writes them
    (collective then)."""
    if not own_part and ctx.world_size > 1:
        parts = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(values, parts, dst=dist.get_global_rank(ctx.group, 0), group=ctx.group)
        if ctx.rank != 0:
            return
        values = torch.cat(parts)
    save_params({DIGEST: sorted_values(values[values != 0])}, folder / digest_name(step, ctx.rank))


def gradient_digest_files(folder: Path, step: int) -> list[Path]:
    """The parts of step `step`'s gradient digest in `folder`, in rank order."""
    return sorted(folder.glob(f"step{step}.grads.rank*.pt"), key=lambda p: int(p.name.split("rank")[1][:-3]))


def read_gradient_digest(folder: Path, step: int) -> torch.Tensor | None:
    """Step `step`'s gradient digest, its parts merged (sorted); None where no part was written."""
    parts = [_digest_part(load_params(p)) for p in gradient_digest_files(folder, step)]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else sorted_values(torch.cat(parts))


def _digest_part(loaded: dict | torch.Tensor) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[DIGEST]  # a tensor: torch.saved by an earlier harness


def sorted_values(values: torch.Tensor) -> torch.Tensor:
    """`values` (flat, on the CPU) in ascending order, NaN last. numpy's sort where it takes the dtype: torch's
    CPU sort is tens of times slower on the tens of thousands of values a small model's step writes
    (reports/performance.md#the-measured-step), and the digest is sorted every step."""
    if values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.sort(values.detach().cpu().numpy()))
    return torch.sort(values).values
