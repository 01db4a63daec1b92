"""A tied vocabulary that no world size divides (tied_vocab33: 4 x 8 + 1 rows, harness/train/models.py):
fsdp_impl, FSDP2 and DDP train it like the plain model at 1, 2 and 4 ranks, and every row trains, the
vocabulary's uneven tail included (`rows_trained`, harness/checks/rows.py). Replicated data, AdamW, 3 steps: a
few seconds of CI; `python -m harness run --impl fsdp_impl,torch_fsdp2,ddp --models tied_vocab33` runs the rest.
At 8 ranks its real tail sits on rank 6 of 8; the mutant `tail_before_last_dropped` (suites/mutants/) is caught
there."""

from __future__ import annotations

import pytest

from harness.core.scenario import REFERENCE_IMPL, build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

IMPLS = ("fsdp_impl", "torch_fsdp2", "ddp")


@pytest.fixture(scope="module")
def ci_run(kept_worlds):
    scenarios = build_matrix(IMPLS, ["tied_vocab33"], [1, 2, 4], ("replicated",), ("adamw",), steps=3)
    return scenarios, run_matrix(scenarios, pool=kept_worlds)


def test_fsdp_impl_fsdp2_and_ddp_train_the_uneven_tied_vocabulary_like_the_plain_model(ci_run):
    scenarios, res = ci_run
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    ran = {v.scenario for v in res.verdicts if v.check == "completed" and v.status == PASS}
    assert {s.id for s in scenarios} <= ran


def test_every_row_of_every_parameter_trains_in_the_reference_and_in_every_run(ci_run):
    """rows_trained held every run to its reference's rows, and the reference moved every row it has (the
    33 vocabulary rows among them): a run that left any row at its initial value would have failed."""
    scenarios, res = ci_run
    passed = {v.scenario for v in res.verdicts if v.check == "rows_trained" and v.status == PASS}
    assert passed == {s.id for s in scenarios if s.impl != REFERENCE_IMPL}
    sc = res.tables["scenarios"]
    mine = sc[sc.impl != REFERENCE_IMPL]
    assert len(mine) and (mine.rows_compared > 0).all() and (mine.rows_moved == mine.rows_compared).all()
