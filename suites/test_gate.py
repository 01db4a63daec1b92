"""The regression gate end to end: a baseline saved from a run gates the next run of the same slice.

The baseline is made in this test, on this machine, so the test holds on any CPU kind or GPU box
whatever machine saved the committed baselines: the same slice run again passes (the run is
deterministic), and the same slice with another learning rate fails, naming the field and the
scenario. `python -m harness compare` gives the same answer as the gate on the same tables.
"""

from pathlib import Path

import pytest

from harness.core.scenario import build_matrix
from harness.execute.executor import run_matrix
from harness.gate.baseline import load_baseline, save_baseline
from harness.gate.compare import compare, compare_table


def _slice(lr):
    return build_matrix(["fsdp_impl"], ["mlp"], [1, 2], ["replicated"], ["adamw"], steps=4, lr=lr)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    res = run_matrix(_slice(1e-2))
    assert not res.failed, [str(v) for v in res.failed]
    return save_baseline(res.tables, res.env, "gate-test", tmp_path_factory.mktemp("baselines"))


def _gate(lr, saved):
    res = run_matrix(_slice(lr))
    return res, [v for v in compare(res.tables, load_baseline(saved), None, env=res.env) if v.scenario]


def test_the_same_slice_run_again_passes_the_gate(saved):
    _, gate = _gate(1e-2, saved)
    ran = {s.id for s in _slice(1e-2)}
    assert {v.scenario for v in gate} == ran, "every scenario of the slice is compared"
    assert {v.check for v in gate} >= {"gate:loss", "gate:max_diff", "gate:peak_mem", "gate:comm_bytes"}
    failed = [str(v) for v in gate if v.status == "fail"]
    assert not failed, "\n".join(failed)


def test_changed_learning_rate_fails_the_gate_naming_the_field(saved):
    res, gate = _gate(2e-2, saved)
    failed = [v for v in gate if v.status == "fail" and v.check == "gate:loss"]
    assert failed, [str(v) for v in gate]
    assert {v.scenario for v in failed} == {s.id for s in _slice(2e-2)}, "every scenario's loss moved"
    # step k's loss is computed before its update: the learning rate first shows in step 2's loss
    assert all(v.step == 2 for v in failed), [str(v) for v in failed]


def test_compare_is_a_view_of_the_gate(saved):
    res, _ = _gate(2e-2, saved)
    base = load_baseline(saved)
    gate = sorted((v.check, v.scenario, v.status) for v in compare(res.tables, base, None, env=res.env))
    table = compare_table(res.tables, base, None, env=res.env)
    assert gate == sorted(zip(table["check"], table["scenario"], table["status"]))
