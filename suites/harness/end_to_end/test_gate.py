"""The regression gate end to end: a baseline saved from a run gates the next run of the same slice.

The baseline is made in this test, on this machine, so the test holds on any CPU kind or GPU box
whatever machine saved the committed baselines: the same slice run again passes (the run is
deterministic); a baseline whose loss moved fails the run, naming the field, the scenario and the
step; the same slice with another learning rate is told the configuration differs, its losses are
not called regressions, and its memory and traffic are still gated. `python -m harness compare`
gives the same answer as the gate on the same tables.
"""

import json
from pathlib import Path

import pytest

from harness.core.scenario import build_matrix
from harness.gate.baseline import load_baseline, save_baseline
from harness.gate.compare import compare, compare_table
from harness.phases import run_matrix


def _slice(lr):
    return build_matrix(["fsdp_impl"], ["mlp"], [1, 2], ["replicated"], ["adamw"], steps=4, lr=lr)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    res = run_matrix(_slice(1e-2))
    assert not res.failed, [str(v) for v in res.failed]
    return save_baseline(res.tables, res.env, "gate-test", tmp_path_factory.mktemp("baselines"))


def _gate(lr, saved):
    res = run_matrix(_slice(lr))
    return res, compare(res.tables, load_baseline(saved), None, env=res.env)


def test_the_same_slice_run_again_passes_the_gate(saved):
    _, verdicts = _gate(1e-2, saved)
    gate = [v for v in verdicts if v.scenario]
    ran = {s.id for s in _slice(1e-2)}
    assert {v.scenario for v in gate} == ran, "every scenario of the slice is compared"
    assert {v.check for v in gate} >= {"gate:loss", "gate:max_diff", "gate:peak_mem", "gate:comm_bytes"}
    failed = [str(v) for v in gate if v.status == "fail"]
    assert not failed, "\n".join(failed)
    assert not [v for v in verdicts if v.check == "gate:configuration"], "the same configuration: nothing to say"


def test_a_moved_loss_fails_the_gate_naming_the_field_and_step(saved, tmp_path):
    doc = json.loads(saved.read_text())
    sid = _slice(1e-2)[-1].id
    doc["scenarios"][sid]["loss"][1] += 1e-6  # step 2
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(doc))
    res = run_matrix(_slice(1e-2))
    failed = [v for v in compare(res.tables, load_baseline(moved), None, env=res.env) if v.status == "fail"]
    assert [(v.check, v.scenario, v.step) for v in failed] == [("gate:loss", sid, 2)], [str(v) for v in failed]
    assert "regressed" in failed[0].message


def test_another_learning_rate_is_a_configuration_difference_not_a_regression(saved):
    _, verdicts = _gate(2e-2, saved)
    assert not [str(v) for v in verdicts if v.status == "fail"]
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert note.status == "skip" and "configuration differs: lr 0.01 -> 0.02" in note.message
    for field in ("loss", "max_diff"):  # the lr changes what is computed: not compared
        assert [(v.status, v.scenario) for v in verdicts if v.check == f"gate:{field}"] == [("skip", "")]
    ran = {s.id for s in _slice(2e-2)}
    for field in ("peak_mem", "state_mem", "comm_bytes"):  # nor what is held or sent: still gated
        assert {(v.scenario, v.status) for v in verdicts if v.check == f"gate:{field}"} == {(s, "pass") for s in ran}


def test_compare_is_a_view_of_the_gate(saved):
    res, _ = _gate(2e-2, saved)
    base = load_baseline(saved)
    gate = sorted((v.check, v.scenario, v.status) for v in compare(res.tables, base, None, env=res.env))
    table = compare_table(res.tables, base, None, env=res.env)
    assert gate == sorted(zip(table["check"], table["scenario"], table["status"]))
