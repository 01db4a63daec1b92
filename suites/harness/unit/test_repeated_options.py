"""An option that takes a value, given twice, is a usage error (harness/options.py [Note: an option given twice]):
argparse would keep the last silently, so `--models a --models b` ran b alone. The pytest plugin's side is in
suites/faults/bad_inputs.py (a pytest process each)."""

from __future__ import annotations

import pytest

from harness import cli
from harness import options as opt

VALUE = ["--models", "--lr", "--world-sizes"]
LONG = [*VALUE, "--no-report", "--world-sizes-x"]


@pytest.mark.parametrize(
    "args, twice",
    [
        (["--models", "a", "--models", "b"], "--models"),
        (["--lr=1", "--lr", "2"], "--lr"),
        (["--models", "a", "--lr", "1"], None),
        (["--no-report", "--no-report"], None),  # a flag takes no value
        (["--models", "a", "--", "--models", "b"], None),  # after --: not options
    ],
)
def test_the_first_option_given_twice_is_found(args, twice):
    assert opt.repeated_option(args, VALUE) == twice


def test_an_unambiguous_prefix_counts_as_the_option_it_abbreviates():
    assert opt.repeated_option(["--mod", "a", "--models", "b"], VALUE, LONG) == "--models"
    assert opt.repeated_option(["--world-sizes", "1", "--world-size", "2"], VALUE, LONG) is None  # two match it


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--models", "mlp", "--models", "tinylm"],
        ["run", "--lr", "1e-2", "--lr=1e-3"],
        ["run", "--world", "1", "--world-sizes", "2"],
        ["plan", "--model", "mlp", "--model", "tinylm"],
        ["localize", "fsdp_impl-mlp-ws2-split-adamw", "--steps", "2", "--steps", "3"],
    ],
)
def test_the_cli_refuses_an_option_given_twice(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith(f"python -m harness {argv[0]}: error: "), err
    assert "is given more than once" in err


def test_the_plugins_check_reads_the_options_the_harness_registered():
    with pytest.raises(opt.argparse.ArgumentTypeError, match="--models is given more than once: it takes one comma"):
        opt.check_not_repeated(["suites/", "--models", "mlp", "-k", "x", "--models=tinylm"])
    opt.check_not_repeated(["suites/", "--models", "mlp", "-k", "x", "-k", "y"])  # pytest's own: not ours to judge
