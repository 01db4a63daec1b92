"""No false alarms: correct implementations pass every check, the proposed ones included.

A harness that catches every mutant by failing everything is worthless; these tests run the
correct implementations (fsdp_impl, PyTorch FSDP2, DDP) through the matrix and require that no
verdict FAILs. KNOWN verdicts (documented deviations of a real implementation, harness/policy.py)
are allowed; the proposed checks (suites/mutants/catalog.py: PROPOSED_CHECKS) have no deviation
list, so they must pass outright. The full matrix under 5 seeds is the slow tier.
"""

from __future__ import annotations

import pytest

from harness.options import DEFAULT_MODELS, DEFAULT_WORLD_SIZES
from harness.scenario import DATA_MODES, OPTIMIZERS, build_matrix
from harness.verdict import FAIL, KNOWN
from suites.mutants.catalog import PROPOSED_CHECKS

CORRECT = ("fsdp_impl", "torch_fsdp2", "ddp")
SEEDS = (0, 1, 2, 3, 4)


def _run(scenarios):
    from harness.run import run_matrix

    res = run_matrix(scenarios)
    proposed = [v for check in PROPOSED_CHECKS for v in check(res.tables)]
    return res, proposed


def _assert_no_false_alarm(scenarios, res, proposed):
    ran = {s.id for s in scenarios}
    assert {v.scenario for v in res.verdicts if v.scenario} == ran, "a scenario got no verdict"
    failed = [str(v) for v in res.verdicts + proposed if v.status == FAIL]
    assert not failed, f"{len(failed)} false alarm(s):\n" + "\n".join(failed)
    unexpected_known = [str(v) for v in proposed if v.status == KNOWN]
    assert not unexpected_known


def test_correct_implementations_pass_quick_matrix():
    """One seed, W in {1, 2}, 3 steps: the cells the mutant suite runs in, for all three correct
    implementations; cheap enough for every CI run."""
    scenarios = build_matrix(CORRECT, list(DEFAULT_MODELS), [1, 2], DATA_MODES, OPTIMIZERS, steps=3)
    res, proposed = _run(scenarios)
    _assert_no_false_alarm(scenarios, res, proposed)
    assert {v.check for v in proposed} == {c.__name__ for c in PROPOSED_CHECKS}


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_correct_implementations_pass_full_matrix(seed):
    """The default matrix (models, world sizes 1/2/4/8, both data modes, both optimizers, 10 steps)
    for each correct implementation, under 5 different seeds (init and data both change)."""
    scenarios = build_matrix(CORRECT, list(DEFAULT_MODELS), list(DEFAULT_WORLD_SIZES), DATA_MODES, OPTIMIZERS,
                             steps=10, seeds=(seed,))
    res, proposed = _run(scenarios)
    _assert_no_false_alarm(scenarios, res, proposed)
