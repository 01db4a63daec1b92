"""Upper limits derived from the machine and the models (harness/limits.py), the temp dir a run writes
into (harness/core/scratch.py), and their place before anything runs (harness/preflight.py)."""

from __future__ import annotations

import argparse
import errno
import io
import os
import shutil
from collections import namedtuple

import pytest
import torch

from harness import limits, preflight
from harness.core import scratch
from harness.options import MatrixOptions
from harness.train.models import get_model_spec


def _refused(fn, *args) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


# -- world size ------------------------------------------------------------------------------------


def test_the_largest_world_size_is_what_fits_the_machine_memory():
    sizes = {"tinylm": limits.model_size("tinylm")}
    per_rank = limits.RANK_OVERHEAD_BYTES + limits.RANK_MODEL_COPIES * sizes["tinylm"].param_bytes
    most = limits.machine_memory_bytes() // per_rank
    limits.check_world_sizes((1, most), sizes)
    message = _refused(limits.check_world_sizes, (1, most + 1), sizes)
    assert message.startswith(f"--world-sizes {most + 1}: at most {most} ranks fit this machine's memory")
    assert "--allow-large" in message


def test_a_larger_model_leaves_room_for_fewer_ranks():
    small, large = limits.model_size("mlp"), limits.model_size("lm_50m")

    def most(s):
        return limits.machine_memory_bytes() // (limits.RANK_OVERHEAD_BYTES + limits.RANK_MODEL_COPIES * s.param_bytes)

    assert most(large) < most(small)
    _refused(limits.check_world_sizes, (most(large) + 1,), {"mlp": small, "lm_50m": large})


# -- steps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "tinylm_tied"])
def test_the_snapshot_size_is_what_a_snapshot_file_of_the_model_takes(name):
    from harness.train.params_file import save_params

    torch.manual_seed(0)
    model = get_model_spec(name).build()
    buf = io.BytesIO()  # what rank 0 writes after each step (harness.train.task._snapshot)
    save_params({k: v.detach().float() for k, v in model.named_parameters()}, buf)
    estimate = limits.model_size(name).snapshot_bytes
    assert abs(estimate - len(buf.getvalue())) <= 64 * len(list(model.parameters()))  # record alignment at most


def test_steps_beyond_the_temp_dirs_free_space_are_refused_naming_how_many_fit(monkeypatch, tmp_path):
    matrix = MatrixOptions(impls=("fsdp_impl",), models=("mlp",), world_sizes=(1, 2), steps=10)
    scenarios, sizes = matrix.scenarios(), {"mlp": limits.model_size("mlp")}
    fits = 7
    free = limits.run_files_bytes(scenarios, sizes, fits) + 1
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(limits.shutil, "disk_usage", lambda path: Usage(2 * free, free, free))
    limits.check_steps(scenarios, sizes, fits, str(tmp_path))
    message = _refused(limits.check_steps, scenarios, sizes, fits + 1, str(tmp_path))
    assert f"--steps {fits + 1}: " in message and f"so at most {fits} steps fit" in message
    assert f"{len(scenarios)} scenarios" in message


def test_the_run_files_grow_by_one_snapshot_per_step_and_scenario():
    matrix = MatrixOptions(impls=("fsdp_impl",), models=("mlp",), world_sizes=(1, 2), data_modes=("split",))
    scenarios, sizes = matrix.scenarios(), {"mlp": limits.model_size("mlp")}
    per_step = limits.run_files_bytes(scenarios, sizes, 2) - limits.run_files_bytes(scenarios, sizes, 1)
    # split data writes no gradient file; the reference trains on replicated data and writes one
    refs = sum(s.data_mode == "replicated" for s in scenarios)
    assert per_step == len(scenarios) * sizes["mlp"].snapshot_bytes + refs * (
        sizes["mlp"].trainable_bytes + sizes["mlp"].snapshot_bytes - sizes["mlp"].param_bytes
    )


# -- planner ---------------------------------------------------------------------------------------


def test_the_planner_stops_at_the_models_largest_dim_0_where_the_state_stops_falling():
    from harness.plan.table import plan_table

    size = limits.model_size("tinylm")
    limits.check_plan_world_sizes("tinylm", (1, size.largest_rows), size)
    message = _refused(limits.check_plan_world_sizes, "tinylm", (size.largest_rows + 1,), size)
    assert f"above {size.largest_rows} ranks (tinylm's largest dim 0)" in message
    table = plan_table("tinylm", ["fsdp_impl"], [size.largest_rows // 2, size.largest_rows, 2 * size.largest_rows])
    half, at, beyond = table["state_total"].tolist()
    assert half > at == beyond  # it falls up to the largest dim 0, not after


# -- the temp dir ----------------------------------------------------------------------------------


def test_a_tmpdir_that_cannot_take_a_file_is_named(monkeypatch, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for bad, reason in ((tmp_path / "missing", os.strerror(errno.ENOENT)), (a_file, "not a directory")):
        monkeypatch.setenv("TMPDIR", str(bad))
        with pytest.raises(scratch.ScratchError, match=f"^TMPDIR {bad} is not writable: {reason}"):
            scratch.temp_dir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert scratch.temp_dir() and list(tmp_path.iterdir()) == [a_file]  # the probe leaves nothing


def test_a_full_disk_while_writing_into_the_temp_dir_ends_the_run_in_one_line(tmp_path):
    with pytest.raises(scratch.ScratchError, match="cannot take the run's files: No space left on device"):
        with scratch.writing_into(tmp_path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert scratch.ScratchError.ends_the_run


def test_an_error_that_is_not_the_temp_dirs_stays_the_scenarios(tmp_path):
    with pytest.raises(PermissionError):  # the folder takes a probe file: not the temp dir's doing
        with scratch.writing_into(tmp_path):
            raise PermissionError(errno.EACCES, "an adapter's own file")
    with pytest.raises(RuntimeError, match="an implementation bug"):
        with scratch.writing_into(tmp_path):
            raise RuntimeError("an implementation bug")


def test_a_refusing_temp_dir_turns_a_write_error_into_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(scratch, "unwritable", lambda folder: "Read-only file system")
    with pytest.raises(scratch.ScratchError, match="Read-only file system"):
        with scratch.writing_into(tmp_path):
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")


def test_a_rank_that_hits_a_full_temp_dir_ends_the_call_with_that_error():
    from harness.execute.world import World

    with World(1) as world, pytest.raises(scratch.ScratchError, match="No space left on device"):
        world.call("suites.harness.unit.world_tasks:temp_dir_full")


# -- preflight -------------------------------------------------------------------------------------


def test_allow_large_lifts_the_limits_but_not_the_temp_dir_check(monkeypatch, tmp_path):
    huge = MatrixOptions(impls=("fsdp_impl",), models=("mlp",), world_sizes=(1, 10**6), data_modes=("replicated",))
    assert "ranks fit this machine's memory" in _refused(preflight.check, huge)
    preflight.check(MatrixOptions(**{**huge.__dict__, "allow_large": True}))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    assert "is not writable" in _refused(preflight.check, MatrixOptions(**{**huge.__dict__, "allow_large": True}))
    assert shutil.disk_usage(tmp_path).free  # the real free space is what check_steps reads


SIZED = ["mlp", "tinylm_tied", "mha_lm", "bn_mlp"]


@pytest.mark.parametrize("model", SIZED)
def test_model_sizes_on_meta_without_fills_are_those_of_the_model_built_for_real(model):
    """model_size builds on the meta device with value fills skipped (nn.init's, which would import
    torch._dynamo in the judging process): every parameter's shape, dtype and trainability must be
    those of the model built on the CPU."""
    with torch.random.fork_rng(devices=[]):
        real = get_model_spec(model).build()
    params = list(real.named_parameters())
    size = limits.model_size(model)
    assert size.param_bytes == sum(p.numel() * p.element_size() for _, p in params)
    assert size.trainable_bytes == sum(p.numel() * p.element_size() for _, p in params if p.requires_grad)
    assert size.largest_rows == max(p.shape[0] if p.dim() else 1 for _, p in params)
    with torch.device("meta"), limits._no_fills_on_meta():
        meta = get_model_spec(model).build()
    assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in meta.named_parameters()] == [
        (n, p.shape, p.dtype, p.requires_grad) for n, p in params
    ]


@pytest.mark.ci  # a fresh interpreter
def test_model_sizes_need_no_torch_dynamo_import():
    """In a fresh interpreter (this one has imported torch._dynamo long ago), sizing every model above
    imports no torch._dynamo: one process for them all."""
    import subprocess
    import sys

    code = (
        f"import sys; from harness.limits import model_size\nfor m in {SIZED!r}: model_size(m)\n"
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
