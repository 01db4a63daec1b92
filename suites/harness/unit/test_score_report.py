"""The mutation score report's controls: a scenario the plain model itself cannot run (a model limit: BatchNorm
under the bf16 policy) is counted apart, as the false-alarm tier counts it, and never read as a failing control."""

from __future__ import annotations

from types import SimpleNamespace

from harness.core.scenario import Scenario
from harness.core.verdict import FAIL, PASS, Verdict
from harness.tables.build import MODEL_LIMIT
from reports.mutation_score import CatalogueRun, MutantResult, escaped_or_alarmed, render
from suites.mutants.catalog import CATALOGUE

REF = Scenario("reference", "bn_mlp", 1, "replicated", "adamw", feature="bf16")
IMPL = Scenario("fsdp_impl", "bn_mlp", 1, "replicated", "adamw", feature="bf16")
LIMIT = Verdict("completed", REF.id, FAIL, None, None, message=f"{MODEL_LIMIT} the plain model itself fails\nTraceback")


def _run(controls: list[Verdict]) -> CatalogueRun:
    m = CATALOGUE[0]
    caught = MutantResult(m, ["x"], [Verdict(m.expected, "x", FAIL, 1.0, 0.0)])
    return CatalogueRun({m.name: caught}, controls, 1.0, run=SimpleNamespace(scenarios=[REF, IMPL]))


def test_a_model_limit_among_the_controls_is_listed_apart_and_is_no_failure():
    run = _run([LIMIT, Verdict("ws1_exact", IMPL.id, PASS, 0.0, 0.0)])
    text = render(run)
    assert "no check failed (apart from 1 model limit(s), below)." in text
    assert f"- {REF.id}: {MODEL_LIMIT} the plain model itself fails\n" in text and "Traceback" not in text
    assert not escaped_or_alarmed(run)


def test_a_failing_control_is_still_a_failure_beside_a_model_limit():
    # the same message on an implementation's scenario is no model limit: only the plain model's own runs are
    bad = Verdict("completed", IMPL.id, FAIL, None, None, message=f"{MODEL_LIMIT} said by an implementation")
    run = _run([LIMIT, bad])
    text = render(run)
    assert "1 FAILED (apart from 1 model limit(s), below):" in text
    assert escaped_or_alarmed(run)
