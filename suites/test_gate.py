"""The regression gate against the committed baseline (reports/baselines/default.json).

A slice of the default matrix, run as it is, passes the gate; the same slice with another
learning rate fails it, and the failure names the field and the scenario.
"""

from pathlib import Path

import pytest

from harness.baseline import load_baseline
from harness.run import apply_gate, run_matrix
from harness.scenario import build_matrix

BASELINE = Path(__file__).resolve().parents[1] / "reports" / "baselines" / "default.json"


def _slice(lr):
    return build_matrix(["fsdp_impl"], ["mlp"], [1, 2], ["replicated"], ["adamw"], steps=10, lr=lr)


@pytest.fixture(scope="module")
def baseline():
    return load_baseline(BASELINE)


def _gate(lr, baseline):
    res = run_matrix(_slice(lr))
    return [v for v in apply_gate(res, baseline, None) if v.scenario]


def test_default_slice_passes_the_gate(baseline):
    gate = _gate(1e-2, baseline)
    ran = {s.id for s in _slice(1e-2)}
    compared = {v.scenario for v in gate if v.check not in ("gate:scenario",)}
    assert ran <= compared, "every scenario of the slice is compared with the baseline"
    not_run = [v for v in gate if v.scenario not in ran]
    assert not_run and all(v.status == "skip" for v in not_run), "baseline scenarios not run are listed, as skips"
    failed = [str(v) for v in gate if v.status == "fail"]
    assert not failed, "\n".join(failed)


def test_changed_learning_rate_fails_the_gate_naming_the_field(baseline):
    gate = _gate(2e-2, baseline)
    failed = [v for v in gate if v.status == "fail"]
    assert any(v.check == "gate:loss" for v in failed), [str(v) for v in gate]
    msg = next(v for v in failed if v.check == "gate:loss").message
    assert "loss" in msg and "fsdp_impl-mlp" in next(v for v in failed if v.check == "gate:loss").scenario
