"""The session's phases (harness.phases) share one pool of worlds, made with the run's scenario timeout: a rank task
of any phase that does not answer within it fails, in the per-sample and batch-invariant phases as in the matrix.

The timeout is far below what any world needs to start (forking its ranks and joining their group), so every
world of every phase is reported hung at its start, whatever the machine: the property is which bound each phase
waits by, not how fast it is."""

from __future__ import annotations

from harness.core.verdict import FAIL
from harness.options import MatrixOptions, SessionOptions
from harness.session import Session

TIMEOUT_S = 1e-9


def test_every_phase_waits_for_its_ranks_by_the_runs_scenario_timeout():
    matrix = MatrixOptions(
        impls=("fsdp_impl",),
        models=("mlp",),
        world_sizes=(1,),
        data_modes=("replicated",),
        optimizers=("sgd",),
        steps=2,
        timeout_s=TIMEOUT_S,
    )
    options = SessionOptions(matrix, report=None, per_sample=True, invariant=True, localize=0)
    res = Session(options, say=lambda line: None).run()
    reference = [v for v in res.verdicts if v.check == "completed" and v.scenario.startswith("reference")]
    by_phase = {
        "matrix": reference,
        "per-sample": [
            v
            for v in res.verdicts
            if v.check in ("per_sample_norms", "clipped_update") and v.scenario.startswith("fsdp_impl")
        ],
        "invariant": [v for v in res.verdicts if v.check.startswith("invariant")],
    }
    for phase, verdicts in by_phase.items():
        assert verdicts, f"the {phase} phase gave no verdict"
        assert all(v.status == FAIL for v in verdicts), (phase, [(v.check, v.status) for v in verdicts])
        assert all("hung" in v.message for v in verdicts), (phase, [v.message[:200] for v in verdicts])
