"""Timing perturbation (`--features jitter`): correct implementations, every collective, wait, forward and
optimizer step of theirs delayed apart on each rank, train bitwise as without the delays
(jitter_invariant) and pass every other check. A couple of cells in CI (mlp, W 2, 3 steps: each delay is
a real sleep); the slow tier's compositions (suites/harness/end_to_end/test_compositions.py) pair jitter with every feature."""

from __future__ import annotations

from harness.core.scenario import build_matrix
from harness.core.verdict import FAIL, PASS
from harness.phases import run_matrix

IMPLS = ("fsdp_impl", "torch_fsdp2", "ddp")


def test_correct_implementations_train_bitwise_alike_under_jitter(kept_worlds):
    scenarios = build_matrix(IMPLS, ["mlp"], [2], ["replicated"], ["adamw"], steps=3, features=("jitter",))
    res = run_matrix(scenarios, pool=kept_worlds)
    failed = [str(v) for v in res.verdicts if v.status == FAIL]
    assert not failed, "\n".join(failed)
    jittered = {s.id for s in scenarios if s.feature == "jitter"}
    held = {v.scenario: v for v in res.verdicts if v.check == "jitter_invariant"}
    assert set(held) == jittered and all(v.status == PASS for v in held.values()), held
    steps = res.tables["steps"]
    for sid in jittered:  # every rank was delayed at every step
        assert (steps[steps.scenario == sid].jitter_delays > 0).all(), sid
