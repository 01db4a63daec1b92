"""No false alarms: correct implementations (fsdp_impl, PyTorch FSDP2, DDP) fail no check.

KNOWN verdicts (documented deviations of a real implementation, harness/core/policy.py) are allowed. The
quick matrix's mlp and AdamW cells run in every CI run, its other cells with ``--slow``; the full matrix under 5 seeds is the slow tier (``--slow``,
about 4 minutes a seed on 2 cores), on the zoo's models and on the standard architectures.
``python -m suites.mutants.score --false-alarm-seeds 0,1,2,3,4``
runs the same tier and writes its table into the mutation score report.
"""

from __future__ import annotations

import pytest

from suites.mutants.false_alarms import SEEDS, full_matrix, quick_matrix, run_false_alarms, standard_matrix


def _assert_no_false_alarm(run):
    assert not run.unjudged, f"scenarios without a verdict: {sorted(run.unjudged)}"
    failed = [str(v) for v in run.false_alarms]
    assert not failed, f"{len(failed)} false alarm(s):\n" + "\n".join(failed)


def _everyday(s) -> bool:
    """The quick matrix's cells on the mlp with AdamW: every feature for all three implementations and
    DDP's plain step, in both data modes at W = 1, 2. Its other cells (tinylm_tied through every feature,
    DDP's plain step on the other models and with SGD) repeat those checks on other numbers."""
    return s.model == "mlp" and s.optimizer == "adamw"


def test_correct_implementations_pass_quick_matrix(kept_worlds):
    _assert_no_false_alarm(run_false_alarms([s for s in quick_matrix() if _everyday(s)], seed=0, pool=kept_worlds))


@pytest.mark.slow
def test_correct_implementations_pass_the_rest_of_the_quick_matrix(kept_worlds):
    _assert_no_false_alarm(run_false_alarms([s for s in quick_matrix() if not _everyday(s)], seed=0, pool=kept_worlds))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_correct_implementations_pass_full_matrix(seed):
    _assert_no_false_alarm(run_false_alarms(full_matrix(seed), seed=seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_correct_implementations_pass_the_standard_architectures(seed):
    _assert_no_false_alarm(run_false_alarms(standard_matrix(seed), seed=seed))


def _synthetic_run():
    """Two implementations, hand-made verdicts: what the report's tables must say about them."""
    from harness.core.scenario import Scenario
    from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, Verdict
    from suites.mutants.false_alarms import FalseAlarmRun

    a, b = Scenario("fsdp_impl", "mlp", 2, "replicated", "adamw"), Scenario("ddp", "mlp", 8, "replicated", "sgd")
    verdicts = [Verdict("cross_ws_replicated", a.id, PASS, 1e-8, 3e-8),
                Verdict("cross_ws_replicated", b.id, KNOWN, 6e-8, 3e-8),
                Verdict("grad_norm_matches", a.id, PASS, 2e-9, 1e-6),
                Verdict("grad_norm_matches", a.id, PASS, 5e-7, 1e-6),
                Verdict("grad_norm_matches", b.id, PASS, 9e-7, 1e-6),
                Verdict("converges", a.id, PASS, -0.1, 0.0),
                Verdict("comm_volume", b.id, SKIP, None, None),
                Verdict("memory_sharding", b.id, FAIL, 2.0, 1.04)]
    return FalseAlarmRun(3, [a, b], verdicts, 1.0)


def test_false_alarm_tables_count_and_rank_the_verdicts():
    from suites.mutants.false_alarms import known, margins, summary

    run = _synthetic_run()
    assert [str(v.check) for v in run.false_alarms] == ["memory_sharding"] and not run.unjudged
    s = summary([run]).set_index("implementation")
    assert s.loc["ddp", ["scenarios", "pass", "known", "skip", "fail"]].tolist() == [1, 1, 1, 1, 1]
    assert s.loc["fsdp_impl", ["pass", "known", "fail"]].tolist() == [4, 0, 0]
    m = margins([run]).set_index(["check", "implementation"])
    # per implementation, the pass nearest its bound; KNOWN, FAIL and a 0 bound never count
    assert m.loc[("grad_norm_matches", "ddp"), "closest pass"] == "9e-07 of 1e-06 (90%)"
    assert m.loc[("grad_norm_matches", "fsdp_impl"), "closest pass"] == "5e-07 of 1e-06 (50%)"
    assert m.loc[("cross_ws_replicated", "fsdp_impl"), "closest pass"].startswith("1e-08 of 3e-08")
    assert set(m.index) == {("grad_norm_matches", "ddp"), ("grad_norm_matches", "fsdp_impl"),
                            ("cross_ws_replicated", "fsdp_impl")}
    k = known([run])
    assert k[["check", "implementation", "verdicts"]].values.tolist() == [["cross_ws_replicated", "ddp", 1]]


def test_a_saved_sweep_resumes_where_it_stopped_and_refuses_another_matrix(tmp_path, monkeypatch):
    """Each model's verdicts are saved as it finishes; a second sweep reads them back (the same verdicts,
    nothing run again) and runs only the models not saved; a file of another matrix is refused."""
    from harness.core.scenario import Scenario
    from harness.core.verdict import FAIL, PASS, Verdict
    from suites.mutants import false_alarms as fa

    def cells(seed, models):
        return [Scenario("fsdp_impl", m, w, "replicated", "adamw", seed=seed) for m in models for w in (1, 2)]

    ran = []

    def fake_run(scenarios, *, seed, pool=None, progress=None):
        ran.append(scenarios[0].model)
        verdicts = [Verdict("cross_ws_replicated", c.id, FAIL if c.world_size == 2 else PASS, 1.5e-7 * c.world_size,
                            3e-8, step=1, param="fc.weight") for c in scenarios]
        return fa.FalseAlarmRun(seed, scenarios, verdicts, 2.0)

    monkeypatch.setattr(fa, "full_matrix", cells)
    monkeypatch.setattr(fa, "run_false_alarms", fake_run)
    first = fa.run_saved(4, ["mlp"], tmp_path)
    assert ran == ["mlp"] and sorted(p.name for p in tmp_path.iterdir()) == ["seed4-mlp.json"]
    both = fa.run_saved(4, ["mlp", "hf:gpt2"], tmp_path)
    assert ran == ["mlp", "hf:gpt2"], "the saved model ran again"
    assert both.verdicts[:2] == first.verdicts and len(both.false_alarms) == 2 and not both.unjudged
    assert (tmp_path / "seed4-hf_gpt2.json").exists()
    import torch

    # each part says where it ran: a resumed sweep's parts may come from different machines
    assert len(both.origins) == 2 and all(f"torch {torch.__version__}" in o for o in both.origins)
    assert both.origins[0].startswith("seed 4, mlp: commit ") and both.origins[1].startswith("seed 4, hf:gpt2:")
    monkeypatch.setattr(fa, "full_matrix", lambda seed, models: cells(seed, models)[:1])
    with pytest.raises(SystemExit, match="another matrix"):
        fa.run_saved(4, ["mlp"], tmp_path)
