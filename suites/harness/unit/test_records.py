"""harness/train/records.py: the run's global figures settled from the ranks' own in one collective per batch of
steps, the gradient digest written in parts or gathered and read back the same, snapshots written in batches."""

from __future__ import annotations

import math

import pytest
import torch

from harness.train.params_file import load_params, save_params
from harness.train.records import DIGEST, Snapshots, gradient_digest_files, read_gradient_digest, sorted_values

TASKS = "suites.harness.unit.world_tasks"


@pytest.mark.parametrize("split, adds_up", [(True, True), (False, True), (True, False), (False, False)])
def test_the_global_figures_are_the_ranks_mean_loss_with_split_data_and_their_summed_norm_where_shards_add_up(
    kept_worlds, split, adds_up
):
    w = 2
    every = kept_worlds.get(w).call(f"{TASKS}:settled_figures", {"split": split, "adds_up": adds_up})
    for rank, records in enumerate(every):
        for k, rec in zip((1, 2), records):
            own_loss, own_eval = 1.0 + rank + k, 10.0 + rank
            # split data: the global batch's loss is the mean of the equal slices' means, the same on every rank
            assert rec["loss"] == ((1.0 + k + 2.0 + k) / 2 if split else own_loss)
            assert rec["eval_loss"] == ((10.0 + 11.0) / 2 if split else own_eval)
            # shards: their squared norms add up; copies: rank 0's
            assert rec["grad_norm"] == math.sqrt((1 * k + 2 * k) if adds_up else 1 * k)


@pytest.mark.parametrize("own_part", [True, False])
def test_the_gradient_digest_reads_back_the_same_written_in_parts_or_gathered(kept_worlds, tmp_path, own_part):
    w = 4
    kept_worlds.get(w).call(f"{TASKS}:gradient_digest", {"folder": str(tmp_path), "own_part": own_part})
    files = gradient_digest_files(tmp_path, 1)
    assert [f.name for f in files] == (
        [f"step1.grads.rank{r}.pt" for r in range(w)] if own_part else ["step1.grads.rank0.pt"]
    )
    expected = torch.tensor(sorted([r + 1.0 for r in range(w)] + [r + 2.0 for r in range(w)]))
    assert torch.equal(read_gradient_digest(tmp_path, 1), expected)
    assert read_gradient_digest(tmp_path, 2) is None


def test_rank_0_holds_the_snapshots_until_a_batch_is_full_and_writes_them_on_flush(tmp_path, monkeypatch):
    import harness.train.records as records

    class Ctx:
        rank, world_size = 0, 1

    class Adapter:
        def __init__(self):
            self.w = torch.zeros(4)

        def full_params(self, wrapped):
            return {"w": self.w}  # the live tensor, as a careless adapter might hand it out

    adapter = Adapter()
    snaps = Snapshots(Ctx(), tmp_path)
    for step in range(3):
        adapter.w.add_(1.0)
        snaps.take(adapter, None, step)
    assert not list(tmp_path.iterdir())  # held: nothing written between steps
    snaps.flush()
    for step in range(3):
        assert torch.equal(load_params(tmp_path / f"step{step}.pt")["w"], torch.full((4,), step + 1.0))
    monkeypatch.setattr(records, "SNAPSHOT_BATCH_BYTES", 16)  # one step's 4 floats fill a batch
    snaps.take(adapter, None, 3)
    assert (tmp_path / "step3.pt").exists() and not snaps.held


def test_a_snapshot_is_gathered_to_rank_0_alone_where_full_params_takes_rank0_only(tmp_path):
    """Every rank calls full_params (it may be collective) with rank0_only=True where it takes the keyword; an
    override without it (a subclass that misreports, a user's adapter) is called as it is, and is what is read."""

    class Ctx:
        rank, world_size = 0, 2

    class Gathers:
        def full_params(self, wrapped, *, rank0_only=False):
            calls.append(rank0_only)
            return {"w": torch.ones(2)} if ctx.rank == 0 or not rank0_only else {}

    class Overrides(Gathers):
        def full_params(self, wrapped):
            calls.append("plain")
            return {"w": torch.full((2,), 3.0)}

    ctx = Ctx()
    for adapter, said, value in ((Gathers(), True, 1.0), (Overrides(), "plain", 3.0)):
        for rank in (1, 0):
            ctx.rank, calls = rank, []
            snaps = Snapshots(ctx, tmp_path)
            snaps.take(adapter, None, 0)
            snaps.flush()
            assert calls == [said]
        assert torch.equal(load_params(tmp_path / "step0.pt")["w"], torch.full((2,), value))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_digest_is_in_the_order_torchs_sort_gives_nan_and_infinities_included(dtype):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5000, generator=g).to(dtype)
    values[::97] = values[5]  # repeated values
    values[3], values[11], values[40] = math.nan, math.inf, -math.inf
    got = sorted_values(values)
    want = torch.sort(values).values
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])


def test_a_digest_part_an_earlier_harness_torch_saved_is_read(tmp_path):
    torch.save(torch.tensor([1.0, 3.0]), tmp_path / "step1.grads.rank0.pt")
    save_params({DIGEST: torch.tensor([2.0])}, tmp_path / "step1.grads.rank1.pt")
    assert torch.equal(read_gradient_digest(tmp_path, 1), torch.tensor([1.0, 2.0, 3.0]))
