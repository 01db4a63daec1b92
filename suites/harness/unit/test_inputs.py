"""Bad options are one usage-error line at parse time (harness.options), and output errors are one
line with nothing left behind (harness.tables.store / harness.report.markdown writers)."""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness import options as opt
from harness.gate.baseline import save_baseline
from harness.report import markdown as report
from harness.tables.store import OutputError, load_tables, save_tables, write_text_atomic

from . import synthetic_tables as syn


def _refused(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse(text)
    message = str(err.value)
    assert "\n" not in message
    return message


# -- numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e309", "0", "-1"])
def test_lr_and_bounds_must_be_finite_and_positive(text):
    assert "must be a finite number > 0" in _refused(opt.positive_float, text)


@pytest.mark.parametrize("text", ["inf", "nan", "1e9", "2147484", "0", "-5"])
def test_scenario_timeout_must_be_finite_positive_and_waitable(text):
    assert "must be a finite number of seconds > 0 and at most 2147483" in _refused(opt.timeout_seconds, text)


@pytest.mark.parametrize("text", ["0.001", "0.5", "0.999"])
def test_a_scenario_timeout_below_the_minimum_names_the_minimum(text):
    message = _refused(opt.timeout_seconds, text)
    assert f"must be at least {opt.MIN_TIMEOUT_S:g} s, got {text}" in message and "world's start" in message


def test_the_longest_scenario_timeout_is_one_a_worker_wait_accepts():
    """The bound is the real one: a wait on the workers' pipes (multiprocessing.connection.wait,
    as harness.execute.world does) takes the longest timeout the parser accepts and refuses a longer one."""
    import multiprocessing
    from multiprocessing.connection import wait

    r, w = multiprocessing.Pipe(duplex=False)
    w.send(1)
    assert wait([r], opt.timeout_seconds("2147483")) == [r]
    with pytest.raises(OverflowError):
        wait([r], 2147484)
    assert opt.timeout_seconds("1") == opt.MIN_TIMEOUT_S and opt.positive_float("1e-3") == 1e-3


# -- paths -----------------------------------------------------------------------------------------


def test_a_report_path_too_long_for_the_file_system_is_one_line(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    message = _refused(opt.report_path, str(tmp_path / ("a" * (name_max + 1)) / "r.md"))
    assert message.startswith("cannot use the report path ") and os.strerror(errno.ENAMETOOLONG) in message
    assert len(message) < 200  # the path is shortened, not printed whole


# -- features and world sizes ----------------------------------------------------------------------


def test_hsdp_needs_world_sizes_that_divide_into_its_replicas():
    from harness.core.features import HSDP_REPLICAS, hsdp_mesh

    odd = (1, 2, HSDP_REPLICAS + 1)
    with pytest.raises(argparse.ArgumentTypeError, match=rf"\[{HSDP_REPLICAS + 1}\] do not"):
        opt.MatrixOptions(world_sizes=odd, features=("hsdp",), data_modes=("replicated",)).validate()
    opt.MatrixOptions(world_sizes=(1, 2, 4), features=("hsdp",), data_modes=("replicated",)).validate()
    opt.MatrixOptions(world_sizes=odd, features=("plain",), data_modes=("replicated",)).validate()
    # world size 1 is kept: one replica of one rank, the run every hsdp run at W > 1 is compared with
    assert hsdp_mesh(1) == (1, 1) and hsdp_mesh(2) == (HSDP_REPLICAS, 1)


# -- seeds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["99999999999999999999", "9223372036854775808", "-9223372036854775809", "0,18446744073709551615"]
)
def test_seeds_outside_64_bit_signed_are_refused_naming_the_range(text):
    message = _refused(opt.seeds, text)
    assert "-9223372036854775808 to 9223372036854775807" in message


def test_the_seed_range_is_what_torch_and_the_stored_tables_take(tmp_path):
    low, high = opt.seeds("-9223372036854775808,9223372036854775807")
    with torch.random.fork_rng(devices=[]):
        for seed in (low, high):
            torch.manual_seed(seed)
        with pytest.raises((ValueError, RuntimeError)):  # one below: torch refuses it
            torch.manual_seed(low - 1)
    tables = {"seeds": pd.DataFrame({"seed": [low, high]})}
    save_tables(tables, {}, tmp_path / "run")
    assert load_tables(tmp_path / "run")[0]["seeds"]["seed"].tolist() == [low, high]
    # one above: torch takes it, but the stored tables do not give it back (int64 columns)
    save_tables({"seeds": pd.DataFrame({"seed": [high + 1]})}, {}, tmp_path / "run")
    assert load_tables(tmp_path / "run")[0]["seeds"]["seed"].tolist() != [high + 1]


# -- steps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1", "0", "-3"])
def test_steps_must_be_at_least_two(text):
    assert _refused(opt.steps, text).startswith(f"must be >= 2 (got {text}): ")


def test_the_least_steps_include_the_step_memory_is_measured_on():
    from harness.train.task import MEASURED_STEP  # 0-based: memory is measured on step MEASURED_STEP + 1

    assert opt.steps("2") == 2 and MEASURED_STEP + 1 <= 2


# -- baselines -------------------------------------------------------------------------------------

NOT_NAMES = ["../x", "a/b", "/tmp/x", ".", "..", ".hidden", "-x", "a b", "", "x\\y", "name\n"]


@pytest.mark.parametrize("text", NOT_NAMES)
def test_save_baseline_takes_a_name_only(text):
    assert "is not a baseline name" in _refused(opt.new_baseline_name, text)


@pytest.mark.parametrize("text", ["default", "cpu-2.13", "gpu_h100", "v1.2.3", "A9"])
def test_save_baseline_names_are_the_ones_save_baseline_writes(text, tmp_path):
    assert opt.new_baseline_name(text) == text
    path = save_baseline(syn.make_tables(world_sizes=(1,), modes=("replicated",)), {}, text, tmp_path)
    assert path.parent == tmp_path / text and path.is_file()


@pytest.mark.parametrize("text", NOT_NAMES)
def test_names_the_parser_refuses_save_baseline_refuses_too(text, tmp_path):
    with pytest.raises(ValueError):
        save_baseline({}, {}, text, tmp_path)


def test_baseline_to_read_may_still_be_a_path():
    assert opt.baseline_name("reports/baselines/default.json") == "reports/baselines/default.json"


def test_the_cli_and_plugin_use_the_name_parser_for_save_baseline():
    seen = {}
    opt.add_gate_arguments(lambda name, **kw: seen.setdefault(name, kw.get("type")))
    assert seen["--save-baseline"] is opt.new_baseline_name and seen["--baseline"] is opt.baseline_name


# -- output errors ---------------------------------------------------------------------------------


def _os_error(code: int, when=lambda *args: True, real=None):
    """A stand-in for an os / pathlib call that fails with `code` when `when(*args)` holds."""

    def call(*args, **kwargs):
        if when(*args):
            raise OSError(code, os.strerror(code), str(args[0]) if args else None)
        return real(*args, **kwargs)

    return call


def _state(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (hidden temp and backup entries included) and its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(directory.rglob("*"))
    }


def _one_line(err: pytest.ExceptionInfo, path: Path, reason: str) -> None:
    assert isinstance(err.value, OutputError) and isinstance(err.value, OSError)
    assert str(err.value) == f"cannot write {path}: {reason}"


SMALL_TABLES = dict(world_sizes=(1, 2), modes=("split",), fail=False)


@pytest.fixture
def old_report(tmp_path, fast_plots) -> Path:
    return report.write_report(syn.make_tables(**SMALL_TABLES), {}, tmp_path / "r.md")


def test_a_full_disk_while_writing_the_report_is_one_line_and_keeps_the_old_one(old_report, monkeypatch):
    before = _state(old_report.parent)
    monkeypatch.setattr(Path, "write_text", _os_error(errno.ENOSPC))
    with pytest.raises(OutputError) as err:
        report.write_report(syn.make_tables(**SMALL_TABLES), {}, old_report, title="second run")
    monkeypatch.undo()
    _one_line(err, old_report, "No space left on device")
    assert err.value.errno == errno.ENOSPC
    assert _state(old_report.parent) == before


def test_a_report_dir_that_turned_read_only_is_one_line(old_report, monkeypatch):
    # as root a chmod does not stop a write: fail the first write into the folder as a read-only one does
    before = _state(old_report.parent)
    monkeypatch.setattr(tempfile, "mkdtemp", _os_error(errno.EACCES))
    with pytest.raises(OutputError) as err:
        report.write_report(syn.make_tables(**SMALL_TABLES), {}, old_report)
    monkeypatch.undo()
    _one_line(err, old_report, "Permission denied")
    assert _state(old_report.parent) == before


@pytest.mark.parametrize("call, code", [("link", errno.EPERM), ("replace", errno.EACCES)])
def test_a_report_whose_old_copy_cannot_be_moved_aside_leaves_no_backup_dir(old_report, monkeypatch, call, code):
    """The old report is kept aside (a hard link for the markdown, a rename for the plots folder)
    until the new one is in place; if that fails, no .old-* folder may stay behind."""
    before = _state(old_report.parent)
    aside = lambda src, dst: ".old-" in str(dst)  # noqa: E731
    monkeypatch.setattr(os, call, _os_error(code, aside, real=getattr(os, call)))
    with pytest.raises(OutputError) as err:
        report.write_report(syn.make_tables(**SMALL_TABLES), {}, old_report)
    monkeypatch.undo()
    assert str(err.value).startswith(f"cannot write {old_report.parent}") and "\n" not in str(err.value)
    assert _state(old_report.parent) == before


def test_a_full_disk_while_saving_the_tables_keeps_the_old_run(tmp_path, monkeypatch):
    directory = tmp_path / "r_tables"
    save_tables(syn.make_tables(**SMALL_TABLES), {}, directory)
    before = _state(tmp_path)
    monkeypatch.setattr(pd.DataFrame, "to_csv", _os_error(errno.ENOSPC))
    with pytest.raises(OutputError) as err:
        save_tables(syn.make_tables(**SMALL_TABLES), {}, directory)
    monkeypatch.undo()
    _one_line(err, directory, "No space left on device")
    assert _state(tmp_path) == before


def test_a_run_dir_that_cannot_be_moved_aside_leaves_no_backup_dir(tmp_path, monkeypatch):
    directory = tmp_path / "r_tables"
    save_tables(syn.make_tables(**SMALL_TABLES), {}, directory)
    before = _state(tmp_path)
    monkeypatch.setattr(os, "replace", _os_error(errno.EACCES, lambda src, dst: src == directory, real=os.replace))
    with pytest.raises(OutputError) as err:
        save_tables(syn.make_tables(**SMALL_TABLES), {}, directory)
    monkeypatch.undo()
    _one_line(err, directory, "Permission denied")
    assert _state(tmp_path) == before


def test_a_full_disk_while_saving_a_baseline_keeps_the_old_one(tmp_path, monkeypatch):
    tables = syn.make_tables(**SMALL_TABLES)
    path = save_baseline(tables, {}, "cpu", tmp_path)
    before = _state(tmp_path)
    real = os.fdopen

    class FullDisk:  # the temp file opens; writing to it fails
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            self.fh.close()

        def write(self, _text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **kw: FullDisk(real(fd, *a, **kw)))
    with pytest.raises(OutputError) as err:
        save_baseline(tables, {}, "cpu", tmp_path)
    monkeypatch.undo()
    _one_line(err, path, "No space left on device")
    assert _state(tmp_path) == before


def test_an_unwritable_folder_for_a_text_file_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "mkstemp", _os_error(errno.EROFS))
    with pytest.raises(OutputError) as err:
        write_text_atomic(tmp_path / "sub" / "score.md", "text")
    monkeypatch.undo()
    _one_line(err, tmp_path / "sub" / "score.md", "Read-only file system")
    assert _state(tmp_path) == {"sub": b"<dir>"}


def test_an_old_report_that_cannot_be_put_back_is_kept_aside_not_deleted(old_report, monkeypatch):
    plots = old_report.parent / "r_plots"
    before = _state(plots)
    real = os.replace

    def replace(src, dst):  # the markdown cannot be replaced, nor the old plots folder put back
        if Path(dst) == old_report or (Path(dst) == plots and ".old-" in str(src)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError):
        report.write_report(syn.make_tables(**SMALL_TABLES), {}, old_report)
    monkeypatch.undo()
    [kept] = old_report.parent.glob(".r_plots.old-*/r_plots")
    assert _state(kept) == before and not plots.exists()


def test_the_torch_free_names_are_the_registries():
    """harness.core.names answers usage errors without importing torch; it must list what the
    registries hold, in the same order (the order the help and the errors show)."""
    from harness.adapters import BUILTINS
    from harness.core import names
    from harness.train.models import MODELS

    assert names.BUILTIN_ADAPTERS == tuple(BUILTINS) and names.MODELS == tuple(MODELS)


def test_a_usage_error_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; from harness.cli import main\n"
        "try: main(['run', '--impl', 'fsdp_impl', '--models', 'mlp', '--data-modes', 'split',"
        " '--world-sizes', '1,3'])\n"
        "except SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    assert "divisible" in out.stderr


def test_a_pytest_usage_error_imports_neither_torch_nor_pandas():
    """The pytest plugin is loaded by every pytest run of an installed package: importing it, as a
    usage error does before anything runs, must not import torch or pandas (1.5 s of every bad-option
    run and of every pytest run that selects no harness test)."""
    import subprocess
    import sys

    code = "import sys, harness.plugin; print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.ci  # a fresh interpreter
def test_the_process_that_judges_a_run_imports_no_rank_side_measurement():
    """The parent (CLI, pytest controller) builds tables and judges them: it needs the ZeRO-3 ideals,
    not DTensor or torch's memory tracker (1.3 s of every CLI and pytest start), which only ranks use."""
    import subprocess
    import sys

    code = (
        "import sys, harness.session, harness.checks.resources, harness.tables.build, harness.measure\n"
        "from harness.measure import ideal_state_bytes, ideal_comm_elements\n"
        "print(sorted(m for m in ('torch.distributed.tensor', 'torch.distributed._tools') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_each_output_is_staged_beside_its_destination_so_file_systems_may_differ(tmp_path, monkeypatch):
    """A report on one file system (a tmpfs /tmp) and the baselines on another: os.replace cannot
    cross them, so every staged output must sit in the folder it is moved into."""
    import errno
    import os

    from harness.tables import store

    real_replace = os.replace

    def replace_within_one_folder(src, dst):
        if Path(src).resolve().parent.parent != Path(dst).resolve().parent:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(src, dst)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(store.os, "replace", replace_within_one_folder)
    report = tmp_path / "elsewhere" / "r.md"
    written = syn.session_with_result(report, "xfs").write_outputs()
    baseline = Path("reports/baselines/xfs/cpu-avx2-torch2.13.0_cpu.json")
    assert report.is_file() and baseline.is_file()
    assert report in written and baseline in written
    assert list(tmp_path.rglob(".fsdp-harness-out-*")) == []


def test_a_failed_baseline_write_leaves_no_new_empty_folder(tmp_path, monkeypatch):
    from harness.tables import store

    monkeypatch.chdir(tmp_path)

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "replace", refuse)
    with pytest.raises(store.OutputError):
        syn.session_with_result(None, "full").write_outputs()
    assert not Path("reports").exists()


def test_gate_strict_without_a_baseline_is_a_usage_error():
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--gate-strict needs --baseline NAME"):
        opt.load_baseline_option(None, None, strict=True)
