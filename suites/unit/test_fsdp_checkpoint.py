"""fsdp_impl.save_sharded / load_sharded in real process worlds (gloo, CPU): a run saved at one
world size and resumed at another is bitwise the uninterrupted run; a checkpoint that does not fit
is refused in one line saying why.

Every rank-side step lives in ``suites/unit/fsdp_worlds/checkpointing.py``. Data is replicated, so
fsdp_impl trains bitwise alike at every world size (its reductions sum in fp64, in rank order):
the uninterrupted run at the loading world size is the reference, step by step. The negative
control shows that the comparison fails when the optimizer state is not restored.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest

from fsdp_impl.checkpoint_format import atomic_save
from fsdp_impl.sharding import ALIGN_ELEMENTS
from harness.train.models import MLP_SIZES

TASKS = "suites.unit.fsdp_worlds.checkpointing"
AT, TOTAL = 2, 4  # save after step 2 of 4: two steps before, two resumed
MODELS = {
    "mlp": {"model": "mlp", "batch": 8},
    "tinylm_tied": {"model": "tinylm_tied", "batch": 4},  # the tied embedding and head: one slot
    "mlp_frozen": {"model": "mlp", "batch": 8, "frozen": ["layers.1.weight"]},  # a shard with no state
}
OPTIMIZERS = {"adamw": (0.02, ["exp_avg", "exp_avg_sq", "step"]), "sgd": (0.05, ["momentum_buffer"])}
# loading world size -> the saving world sizes it resumes from: every pair among 1, 2, 4, and 8 <-> 3
LOADS = {1: (1, 2, 4), 2: (1, 2, 4), 4: (1, 2, 4), 3: (8,), 8: (3,)}


def run(world, n: int, task: str, payload) -> list:
    return world(n).call(f"{TASKS}:{task}", payload)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Bitwise equal: the same names, dtypes, shapes and bits."""
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


def save_runs(world, tmp_path, payload: dict, sizes) -> dict[int, list]:
    """Per world size: the run that saved after step AT (to tmp_path/ws<n>) and went on to TOTAL,
    its full parameters after every step (index 0: initial)."""
    return {n: run(world, n, "save_run", {**payload, "path": str(tmp_path / f"ws{n}")})[0]["params"]
            for n in sizes}


# ------------------------------------------------------------------------- resuming, bitwise

@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_resumed_at_any_world_size_is_bitwise_the_uninterrupted_run(world, tmp_path, model, optimizer):
    lr, keys = OPTIMIZERS[optimizer]
    payload = {**MODELS[model], "optimizer": optimizer, "lr": lr, "at": AT, "total": TOTAL}
    refs = save_runs(world, tmp_path, payload, sorted(LOADS))
    for n, params in refs.items():  # the premise: replicated data trains bitwise alike at every W
        assert all(same(a, b) for a, b in zip(params, refs[1])), f"W={n} is not bitwise W=1"
    assert not same(refs[1][AT], refs[1][0])  # training moved the weights before the save
    for wl, sources in LOADS.items():
        results = run(world, wl, "load_run", {**payload, "sources": [str(tmp_path / f"ws{ws}") for ws in sources]})
        for i, ws in enumerate(sources):
            got, pair = results[0][i], f"saved at W={ws}, loaded at W={wl}"
            assert same(got["loaded"], refs[ws][AT]), f"{pair}: parameters right after load"
            for step, params in enumerate(got["params"], start=AT + 1):
                assert same(params, refs[wl][step]), f"{pair}: step {step}"
            assert got["lrs"] == [lr], pair  # the saved hyper-parameters, not the new optimizer's 7x
            assert got["state_keys"] == keys, pair
            for r, rank_result in enumerate(results):
                assert rank_result[i]["padding_max"] == 0.0, f"{pair}: rank {r}'s shard padding"
                assert rank_result[i]["state_padding_max"] == 0.0, f"{pair}: rank {r}'s optimizer state padding"


def test_parameters_outside_every_unit_are_saved_whole(world, tmp_path):
    """The last layer in no unit (no root unit either): rank 0 saves it and its state whole."""
    payload = {"model": "mlp", "batch": 8, "plain_tail": True, "optimizer": "adamw", "lr": 0.02,
               "at": AT, "total": TOTAL}
    refs = save_runs(world, tmp_path, payload, [2, 3])
    assert "plain.pt" in os.listdir(tmp_path / "ws2")
    for wl, ws in ((3, 2), (2, 3)):
        got = run(world, wl, "load_run", {**payload, "sources": [str(tmp_path / f"ws{ws}")]})[0][0]
        assert same(got["loaded"], refs[ws][AT])
        assert all(same(p, refs[wl][s]) for s, p in enumerate(got["params"], start=AT + 1))


@pytest.mark.parametrize("ws, wl", [(2, 4), (4, 1)])
def test_saved_before_the_first_step(world, tmp_path, ws, wl):
    """An optimizer with no state yet: the hyper-parameters come back, the state stays empty."""
    payload = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": 0, "total": 2}
    refs = save_runs(world, tmp_path, payload, sorted({ws, wl}))
    got = run(world, wl, "load_run", {**payload, "sources": [str(tmp_path / f"ws{ws}")]})[0][0]
    assert got["state_keys"] == [] and got["lrs"] == [0.02]
    assert same(got["loaded"], refs[ws][0])
    assert all(same(p, refs[wl][s]) for s, p in enumerate(got["params"], start=1))


def test_losing_the_optimizer_state_is_caught(world, tmp_path):
    """Negative control: the parameters alone (a fresh AdamW with the right learning rate) resume
    from the right point but not on the uninterrupted trajectory."""
    payload = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": AT, "total": TOTAL}
    refs = save_runs(world, tmp_path, payload, [2])
    got = run(world, 2, "load_run", {**payload, "params_only": True, "sources": [str(tmp_path / "ws2")]})[0][0]
    assert same(got["loaded"], refs[2][AT])
    assert not same(got["params"][0], refs[2][AT + 1])


def test_a_rank_reads_only_the_saved_files_its_range_overlaps(world, tmp_path):
    payload = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": 1, "total": 1}
    save_runs(world, tmp_path, payload, [8])
    opened = run(world, 2, "files_read", {**payload, "path": str(tmp_path / "ws8")})
    # each MLP layer is a unit: weight, then bias at the next aligned offset
    used = [-(-a * b // ALIGN_ELEMENTS) * ALIGN_ELEMENTS + b for a, b in zip(MLP_SIZES[:-1], MLP_SIZES[1:])]
    for r in range(2):
        want = set()
        for u in used:
            lo, top = r * math.ceil(u / 2), min((r + 1) * math.ceil(u / 2), u)
            s = math.ceil(u / 8)
            want |= {f"shard-{k:05d}-of-00008.pt" for k in range(8) if k * s < top and (k + 1) * s > lo}
        assert opened[r] == sorted(want), f"rank {r}"
        assert len(opened[r]) < 8


# ---------------------------------------------------------------------------------- refusals

def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(world, tmp_path):
    base = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": 1, "total": 1}
    for name, extra in (("good", {}), ("again", {}), ("no_opt", {"with_optimizer": False})):
        run(world, 2, "save_run", {**base, **extra, "path": str(tmp_path / name)})
    shutil.copytree(tmp_path / "good", tmp_path / "missing")
    os.remove(tmp_path / "missing" / "shard-00001-of-00002.pt")
    shutil.copytree(tmp_path / "good", tmp_path / "mixed")
    shutil.copy(tmp_path / "again" / "shard-00001-of-00002.pt", tmp_path / "mixed")
    (tmp_path / "empty").mkdir()
    cases = [
        ({"model": "tinylm_tied"}, "good", ["a different model", "units", "'layers.0'", "'blocks.0'"]),
        ({"sizes": [13, 37, 31, 7]}, "good",
         ["a different model", "'layers.1._fsdp_flat_param0' slot 0", "(31, 37)", "(29, 37)"]),
        ({"frozen": ["layers.1.weight"]}, "good", ["unit 'layers.1' has 2 flat parameter(s) here but 1"]),
        ({"optimizer": "sgd"}, "good", ["AdamW", "SGD"]),
        ({}, "no_opt", ["holds no optimizer state", "optimizer=None"]),
        ({}, "missing", ["saved by 2 ranks", "is missing 'shard-00001-of-00002.pt'"]),
        ({}, "mixed", ["shard-00001-of-00002.pt belongs to another save"]),
        ({}, "empty", ["no complete checkpoint", "meta.pt is missing"]),
    ]
    for extra, ckpt, fragments in cases:
        results = run(world, 2, "load_error", {**base, **extra, "path": str(tmp_path / ckpt)})
        msg = results[0]["message"]
        assert results[1]["message"] == msg, (ckpt, extra)  # every rank refuses alike, even where
        # only one rank reads the bad file ("mixed": rank 1's)
        assert msg.startswith("load_sharded: ") and "\n" not in msg, msg
        assert all(f in msg for f in fragments), (fragments, msg)
        assert all(r["untouched"] for r in results), (ckpt, extra)  # nothing changed on any rank
    assert [r["message"] for r in run(world, 2, "load_error", {**base, "path": str(tmp_path / "good")})] == ["", ""]


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(world, tmp_path):
    """Rank 1's file name is taken by a directory: rank 1's rename fails, both ranks raise the same
    line (rank 0 does not wait forever at the next step) and no meta.pt marks the save complete."""
    (tmp_path / "ckpt" / "shard-00001-of-00002.pt").mkdir(parents=True)
    messages = run(world, 2, "save_error", {**MODELS["mlp"], "path": str(tmp_path / "ckpt")})
    assert messages[0] == messages[1], messages
    assert messages[0].startswith(f"save_sharded: cannot write the checkpoint at {tmp_path / 'ckpt'}: ")
    assert "\n" not in messages[0]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]


def test_a_failed_write_leaves_no_file(tmp_path):
    """atomic_save: the final name appears complete or not at all; no temporary is left."""
    target = tmp_path / "shard-00000-of-00001.pt"
    with pytest.raises(Exception):
        atomic_save({"unpicklable": lambda: None}, str(target))
    assert os.listdir(tmp_path) == []
