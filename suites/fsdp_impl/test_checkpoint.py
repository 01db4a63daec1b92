"""fsdp_impl.save_sharded / load_sharded (on torch.distributed.checkpoint) in real process worlds
(gloo, CPU): a run saved at one world size and resumed at another is bitwise the uninterrupted run;
a checkpoint that does not fit is refused in one line saying why; and torch's own DCP flow
(get_state_dict, dcp.save, dcp.load, set_state_dict) works on an fsdp_impl model alike.

Every rank-side step lives in ``suites/fsdp_impl/worlds/checkpointing.py``. Data is replicated, so
fsdp_impl trains bitwise alike at every world size (its reductions sum in fp64, in rank order):
the uninterrupted run at the loading world size is the reference, step by step. The negative
control shows that the comparison fails when the optimizer state is not restored.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from fsdp_impl.checkpoint import atomic_write
from fsdp_impl.sharding import row_range
from harness.train.models import MLP_SIZES

TASKS = "suites.fsdp_impl.worlds.checkpointing"
AT, TOTAL = 2, 4  # save after step 2 of 4: two steps before, two resumed
MODELS = {
    "mlp": {"model": "mlp", "batch": 8},
    "tinylm_tied": {"model": "tinylm_tied", "batch": 4},  # the tied embedding and head: one parameter
    "mlp_frozen": {"model": "mlp", "batch": 8, "frozen": ["layers.1.weight"]},  # a parameter with no state
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
    return {n: run(world, n, "save_run", {**payload, "path": str(tmp_path / f"ws{n}")})[0]["params"] for n in sizes}


# ------------------------------------------------------------------------- resuming, bitwise

# CI (the CI tier, --ci) covers each model's case and each optimizer's state once: the tied parameter with AdamW's
# state, the stateless frozen parameter beside SGD's momentum (mlp_frozen is the mlp with one layer frozen); the
# other pairs repeat those and are the slow tier's. The default tier resumes fsdp_impl's checkpoints through the
# tests below (the tied parameter with AdamW's state on other meshes, DCP's state-dict path, an unstepped save)
# and the ckpt feature's cells (the mutant catalogue, the compositions with ckpt).
DEFAULT_PAIRS = {("tinylm_tied", "adamw"): pytest.mark.ci, ("mlp_frozen", "sgd"): pytest.mark.ci}


@pytest.mark.parametrize(
    "model, optimizer",
    [
        pytest.param(m, o, id=f"{m}-{o}", marks=DEFAULT_PAIRS.get((m, o), pytest.mark.slow))
        for m in MODELS
        for o in OPTIMIZERS
    ],
)
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
                assert rank_result[i]["state_shapes_ok"], f"{pair}: rank {r}'s optimizer state is not its rows"


@pytest.mark.parametrize(
    "save, load",
    [  # the load at 8 ranks: the CI tier's (--ci)
        ((4, 2), (2, 1)),
        ((2, 1), (4, 2)),
        pytest.param((4, 2), (8, 4), marks=pytest.mark.ci),
    ],
    ids=["2x2->2", "2->2x2", "2x2->2x4"],
)
def test_hybrid_sharded_checkpoints_resume_anywhere(world, tmp_path, save, load):
    """HSDP: the replicas write the same rows once (DCP keeps one copy); a load at any mesh, hybrid
    or not, is bitwise the uninterrupted run (replicated data trains bitwise alike on every mesh)."""
    (ws, rs), (wl, rl) = save, load
    payload = {**MODELS["tinylm_tied"], "optimizer": "adamw", "lr": 0.02, "at": AT, "total": TOTAL}
    saved = run(world, ws, "save_run", {**payload, "replicas": rs, "path": str(tmp_path / "saved")})[0]["params"]
    refs = save_runs(world, tmp_path / "ref", payload, [1])
    assert all(same(a, b) for a, b in zip(saved, refs[1]))
    got = run(world, wl, "load_run", {**payload, "replicas": rl, "sources": [str(tmp_path / "saved")]})[0][0]
    assert same(got["loaded"], refs[1][AT])
    for step, params in enumerate(got["params"], start=AT + 1):
        assert same(params, refs[1][step]), f"step {step}"


def test_parameters_outside_every_unit_are_saved_whole(world, tmp_path):
    """The last layer in no unit (no root unit either): a plain tensor on every rank, saved once."""
    payload = {
        "model": "mlp",
        "batch": 8,
        "plain_tail": True,
        "optimizer": "adamw",
        "lr": 0.02,
        "at": AT,
        "total": TOTAL,
    }
    refs = save_runs(world, tmp_path, payload, [2, 3])
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


def test_a_rank_reads_only_the_saved_files_its_rows_overlap(world, tmp_path):
    """Saved at 8 ranks, loaded at 2: each rank opens the files of the saving ranks that held any of
    its new rows (one file per saving rank, ``__<rank>_0.distcp``), not all eight. (Values saved
    whole, such as Adam's step, live in some one file, which may add one.)"""
    payload = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": 1, "total": 1}
    save_runs(world, tmp_path, payload, [8])
    opened = run(world, 2, "files_read", {**payload, "path": str(tmp_path / "ws8")})
    for r in range(2):
        want = set()
        for rows in MLP_SIZES[1:]:  # each layer's weight and bias have its output size as rows
            lo, hi = row_range(rows, 2, r)
            want |= {
                f"__{k}_0.distcp"
                for k in range(8)
                if max(lo, row_range(rows, 8, k)[0]) < min(hi, row_range(rows, 8, k)[1])
            }
        assert want <= set(opened[r]), f"rank {r}: {opened[r]}"
        assert len(opened[r]) <= len(want) + 1 < 8, f"rank {r}: {opened[r]}"


@pytest.mark.parametrize("ws, wl", [(2, 3), (4, 1)])
def test_torch_dcp_with_get_and_set_state_dict_resumes_at_another_world_size(world, tmp_path, ws, wl):
    """The FSDP2 recipe, unchanged, on fsdp_impl: state_dict DTensors saved at ws ranks, loaded at wl,
    bitwise the uninterrupted run at wl (replicated data)."""
    payload = {**MODELS["tinylm_tied"], "optimizer": "adamw", "lr": 0.02, "at": AT, "total": TOTAL}
    refs = save_runs(world, tmp_path / "ref", payload, [wl])
    run(world, ws, "dcp_round_trip", {**payload, "mode": "save", "path": str(tmp_path / "dcp")})
    got = run(world, wl, "dcp_round_trip", {**payload, "mode": "load", "path": str(tmp_path / "dcp")})[0]
    assert same(got["params"][0], refs[wl][AT])
    for step, params in enumerate(got["params"][1:], start=AT + 1):
        assert same(params, refs[wl][step]), f"step {step}"


# ---------------------------------------------------------------------------------- refusals


def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(world, tmp_path):
    base = {**MODELS["mlp"], "optimizer": "adamw", "lr": 0.02, "at": 1, "total": 1}
    for name, extra in (("good", {}), ("no_opt", {"with_optimizer": False})):
        run(world, 2, "save_run", {**base, **extra, "path": str(tmp_path / name)})
    shutil.copytree(tmp_path / "good", tmp_path / "missing")
    os.remove(tmp_path / "missing" / "__1_0.distcp")
    (tmp_path / "empty").mkdir()
    cases = [
        (
            {"model": "tinylm_tied"},
            "good",
            ["a different model", "only in the checkpoint: 'layers.0.bias'", "only here: 'blocks.0."],
        ),
        (
            {"sizes": [13, 37, 31, 7]},
            "good",
            ["a different model", "'layers.1.weight' is (31, 37) float32 here but (29, 37) float32 in the checkpoint"],
        ),
        ({"optimizer": "sgd"}, "good", ["AdamW", "SGD"]),
        ({}, "no_opt", ["holds no optimizer state", "optimizer=None"]),
        ({}, "missing", ["saved by 2 ranks", "is missing '__1_0.distcp'"]),
        ({}, "empty", ["no complete checkpoint", "fsdp_impl.json is missing"]),
    ]
    for extra, ckpt, fragments in cases:
        results = run(world, 2, "load_error", {**base, **extra, "path": str(tmp_path / ckpt)})
        msg = results[0]["message"]
        assert results[1]["message"] == msg, (ckpt, extra)  # every rank refuses alike
        assert msg.startswith("load_sharded: ") and "\n" not in msg, msg
        assert all(f in msg for f in fragments), (fragments, msg)
        assert all(r["untouched"] for r in results), (ckpt, extra)  # nothing changed on any rank
    assert [r["message"] for r in run(world, 2, "load_error", {**base, "path": str(tmp_path / "good")})] == ["", ""]
    # a parameter frozen here but trained when saved: the same parameters, the same optimizer groups
    frozen = run(world, 2, "load_error", {**base, "frozen": ["layers.1.weight"], "path": str(tmp_path / "good")})
    assert [r["message"] for r in frozen] == ["", ""]


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(world, tmp_path):
    """Rank 1's file name is taken by a directory: rank 1's write fails, both ranks raise the same
    line (rank 0 does not wait forever at the next step) and no fsdp_impl.json marks the save complete."""
    (tmp_path / "ckpt" / "__1_0.distcp").mkdir(parents=True)
    messages = run(world, 2, "save_error", {**MODELS["mlp"], "path": str(tmp_path / "ckpt")})
    assert messages[0] == messages[1], messages
    assert messages[0].startswith(
        f"save_sharded: cannot write the checkpoint at {tmp_path / 'ckpt'}: rank 1: IsADirectoryError: "
    )
    assert "\n" not in messages[0] and "Traceback" not in messages[0]
    assert "fsdp_impl.json" not in os.listdir(tmp_path / "ckpt")


def test_a_failed_write_leaves_no_file(tmp_path):
    """atomic_write: the final name appears complete or not at all; no temporary is left."""
    target = tmp_path / "fsdp_impl.json"
    with pytest.raises(TypeError):
        atomic_write(str(target), None)
    assert os.listdir(tmp_path) == []
