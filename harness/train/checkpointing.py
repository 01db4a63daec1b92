"""The ckpt feature in the rank task: a saver's run saves its checkpoint after `ckpt_step(steps)`, a
resumed run loads it at its own world size and goes on from there.

The saver is the same implementation's plain run at another world size (harness.core.scenario
Scenario.saver); the executor runs every saver before any resumed run. Besides the adapter's own
checkpoint (``<saver snapshots>/ckpt/``, written and read by the adapter's save_checkpoint /
load_checkpoint), rank 0 of the saver leaves the records of the steps it trained
(``ckpt_steps.pt``), and rank 0 of the resumed run copies the saver's snapshots of those steps into
its own folder: its trajectory reads as one run, the first steps trained at `resume_from` ranks,
the rest at its own. Its snapshot of the last saved step is its own, taken right after loading.

Beside the parameters, the optimizer state the ranks hold is written by the harness itself
(harness.measure.optim_state, gathered to rank 0): the saver's right after saving (``ckpt_state.pt``),
the resumed run's right after loading (``restored_state.pt``), for check ``ckpt_restored``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from harness.train.records import gradient_digest_files

CHECKPOINT = "ckpt"  # the adapter's checkpoint folder, in the saver's snapshot folder
STEPS = "ckpt_steps.pt"  # the saver's step records up to the checkpoint
SAVED_STATE = "ckpt_state.pt"  # in the saver's folder: every rank's optimizer state when it saved
RESTORED_STATE = "restored_state.pt"  # in the resumed run's folder: every rank's right after loading


class CheckpointMissing(RuntimeError):
    """A resumed run found no checkpoint: its saver did not complete (or saved nothing)."""


class Checkpointing:
    def __init__(self, payload: dict, snap_dir: Path, rank: int):
        self.save_at = payload.get("save_checkpoint_at")  # this run is a saver: after which step
        saver = payload.get("checkpoint_of")  # this run resumes from that run's checkpoint
        self.source = None if saver is None else Path(payload["snapshot_dir"]) / saver
        self.snap_dir, self.rank = snap_dir, rank

    def resume(self, adapter, wrapped, optimizer, write_state: Callable[[Path], None]) -> list[dict]:
        """Load the saver's checkpoint into the freshly wrapped model and optimizer (collective), then
        `write_state` (collective) the optimizer state the ranks hold; the saver's step records, whose
        snapshots rank 0 copies here. [] for a run that is not resumed."""
        if self.source is None:
            return []
        folder, records = self.source / CHECKPOINT, self.source / STEPS
        if not records.exists():
            raise CheckpointMissing(
                f"no checkpoint in {self.source.name}: that run did not save one (see its own verdicts)"
            )
        steps = torch.load(records, weights_only=True)
        adapter.load_checkpoint(wrapped, optimizer, folder)
        write_state(self.snap_dir / RESTORED_STATE)
        if self.rank == 0:
            for k in range(len(steps) + 1):
                files = ([] if k == len(steps) else [self.source / f"step{k}.pt"]) + (
                    gradient_digest_files(self.source, k) if k else []
                )
                for path in files:
                    if path.exists():
                        shutil.copyfile(path, self.snap_dir / path.name)
        return list(steps)

    def saves_after(self, step: int) -> bool:
        """Whether this run saves its checkpoint after step `step` (its records must be whole by then)."""
        return self.save_at is not None and step == self.save_at

    def save_after(
        self, step: int, adapter, wrapped, optimizer, steps: list[dict], write_state: Callable[[Path], None]
    ) -> None:
        """After the saver's step `save_at`: the adapter's checkpoint and the optimizer state the ranks
        hold (`write_state`; both collective), then the records."""
        if not self.saves_after(step):
            return
        folder = self.snap_dir / CHECKPOINT
        folder.mkdir(parents=True, exist_ok=True)
        adapter.save_checkpoint(wrapped, optimizer, folder)
        write_state(self.snap_dir / SAVED_STATE)
        if self.rank == 0:
            tmp = self.snap_dir / (STEPS + ".tmp")
            torch.save(list(steps), tmp)
            tmp.replace(self.snap_dir / STEPS)  # written last: its presence means the checkpoint is whole
