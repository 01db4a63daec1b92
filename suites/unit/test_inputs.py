"""Bad options are one usage-error line at parse time (harness.options), and output errors are one
line with nothing left behind (harness.store / harness.report writers)."""

from __future__ import annotations

import argparse

import pandas as pd
import pytest
import torch

from harness import options as opt
from harness.baseline import save_baseline
from harness.store import load_run, save_run
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


def test_the_longest_scenario_timeout_is_one_a_worker_wait_accepts():
    """The bound is the real one: a wait on the workers' pipes (multiprocessing.connection.wait,
    as harness.world does) takes the longest timeout the parser accepts and refuses a longer one."""
    import multiprocessing
    from multiprocessing.connection import wait

    r, w = multiprocessing.Pipe(duplex=False)
    w.send(1)
    assert wait([r], opt.timeout_seconds("2147483")) == [r]
    with pytest.raises(OverflowError):
        wait([r], 2147484)
    assert opt.timeout_seconds("0.5") == 0.5 and opt.positive_float("1e-3") == 1e-3


# -- seeds -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["99999999999999999999", "9223372036854775808", "-9223372036854775809",
                                  "0,18446744073709551615"])
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
    save_run(tables, {}, tmp_path / "run")
    assert load_run(tmp_path / "run")[0]["seeds"]["seed"].tolist() == [low, high]
    # one above: torch takes it, but the stored tables do not give it back (int64 columns)
    save_run({"seeds": pd.DataFrame({"seed": [high + 1]})}, {}, tmp_path / "run")
    assert load_run(tmp_path / "run")[0]["seeds"]["seed"].tolist() != [high + 1]


# -- steps -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["1", "0", "-3"])
def test_steps_must_be_at_least_two(text):
    assert _refused(opt.steps, text).startswith(f"must be >= 2 (got {text}): ")


def test_the_least_steps_include_the_step_memory_is_measured_on():
    from harness.train import MEASURED_STEP  # 0-based: memory is measured on step MEASURED_STEP + 1

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
    assert path == tmp_path / f"{text}.json" and path.is_file()


@pytest.mark.parametrize("text", NOT_NAMES)
def test_names_the_parser_refuses_save_baseline_refuses_too(text, tmp_path):
    with pytest.raises(ValueError):
        save_baseline({}, {}, text, tmp_path)


def test_baseline_to_read_may_still_be_a_path():
    assert opt.baseline_name("reports/baselines/default.json") == "reports/baselines/default.json"


def test_the_cli_and_plugin_use_the_name_parser_for_save_baseline():
    seen = {}
    opt.add_gate_arguments(lambda name, **kw: seen.setdefault(name, kw["type"]))
    assert seen["--save-baseline"] is opt.new_baseline_name and seen["--baseline"] is opt.baseline_name
