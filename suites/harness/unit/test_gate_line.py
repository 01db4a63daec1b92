"""What the console says of the gate (harness/core/outcome.py): the figures it compared, and the fields it left
uncompared with why; a baseline named as it was asked for, never by the name a copied file keeps inside; and where
a baseline name is looked for (relative to the current directory, said in the line a missing one gets)."""

from __future__ import annotations

import shutil

import pytest

from harness.checks.registry import verdict_table
from harness.core.environment import machine_kind
from harness.core.outcome import outcome
from harness.gate.baseline import BaselineError, load_baseline, save_baseline
from harness.gate.compare import compare
from harness.gate.tolerance import FIELDS

from . import synthetic_tables as syn


@pytest.fixture(scope="module")
def tables():
    return syn.make_tables(fail=False)


def _gate_line(tables, verdicts) -> str:
    return outcome(tables["scenarios"], verdict_table(verdicts)).gate


def _configured(tables: dict, column: str, value) -> dict:
    return tables | {"scenarios": tables["scenarios"].assign(**{column: value})}


def test_the_gate_line_says_which_fields_a_configuration_change_left_uncompared_and_why(tables, tmp_path):
    saved = save_baseline(tables, syn.ENV, "mine", tmp_path)
    lr = float(tables["scenarios"]["lr"].iloc[0])
    verdicts = compare(_configured(tables, "lr", 2 * lr), load_baseline(saved), env=syn.ENV)
    skipped = [v for v in verdicts if v.check in ("gate:loss", "gate:max_diff")]
    assert {(v.status, v.scenario) for v in skipped} == {("skip", "")}  # what the line reads
    line = _gate_line(tables, verdicts)
    assert line.startswith("gate: ") and "figures compared with the baseline" in line, line
    assert "; loss, max_diff not compared: configuration differs (lr " in line, line
    off = [f for f, (t, _) in FIELDS.items() if t.off]
    assert off and not any(f"{f} not compared" in line or f"gate off for {f}" in line for f in off), line


def test_the_gate_line_says_losses_were_not_compared_with_another_machine_kinds_file(tables, tmp_path):
    """A baseline with a file of another CPU kind only: memory and traffic compared, losses not; the line says so,
    and names the baseline as the run asked for it, though the file was saved under another name."""
    saved = save_baseline(tables, syn.ENV, "saved_as", tmp_path)
    (tmp_path / "asked_for").mkdir()
    shutil.copy(saved, tmp_path / "asked_for" / saved.name)
    env = {**syn.ENV, "cpu_capability": "AVX512" if syn.ENV.get("cpu_capability") != "AVX512" else "AVX2"}
    base = load_baseline("asked_for", tmp_path, kind=machine_kind(env))
    assert base.wanted_kind and base.name == "asked_for"
    line = _gate_line(tables, compare(tables, base, env=env))
    assert "; loss, max_diff not compared: baseline 'asked_for' has no file for this machine kind" in line, line
    assert "saved_as" not in line


def test_a_baseline_read_by_path_is_named_by_that_path(tables, tmp_path):
    saved = save_baseline(tables, syn.ENV, "saved_as", tmp_path)
    assert load_baseline(str(saved)).name == str(saved)


def test_a_missing_baseline_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BaselineError) as e:
        load_baseline("nowhere")
    assert f"no reports/baselines/nowhere/*.json (relative to the current directory, {tmp_path})" in str(e.value)
