"""No false alarms: correct implementations (fsdp_impl, PyTorch FSDP2, DDP) fail no check.

KNOWN verdicts (documented deviations of a real implementation, harness/core/policy.py) are allowed. The
quick matrix's mlp and AdamW cells run in every CI run (the CI tier, ``--ci``), its other cells with ``--slow``; the full matrix under 5 seeds is the slow tier (``--slow``,
about 4 minutes a seed on 2 cores), on the zoo's models and on the standard architectures.
``python -m reports.mutation_score --false-alarm-seeds 0,1,2,3,4``
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


@pytest.mark.ci  # the equivalence matrix, the compositions and the standard models hold it for the default tier
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
    verdicts = [
        Verdict("cross_ws_replicated", a.id, PASS, 1e-8, 3e-8),
        Verdict("cross_ws_replicated", b.id, KNOWN, 6e-8, 3e-8),
        Verdict("grad_norm_matches", a.id, PASS, 2e-9, 1e-6),
        Verdict("grad_norm_matches", a.id, PASS, 5e-7, 1e-6),
        Verdict("grad_norm_matches", b.id, PASS, 9e-7, 1e-6),
        Verdict("converges", a.id, PASS, -0.1, 0.0),
        Verdict("comm_volume", b.id, SKIP, None, None),
        Verdict("memory_sharding", b.id, FAIL, 2.0, 1.04),
    ]
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
    assert set(m.index) == {
        ("grad_norm_matches", "ddp"),
        ("grad_norm_matches", "fsdp_impl"),
        ("cross_ws_replicated", "fsdp_impl"),
    }
    k = known([run])
    assert k[["check", "implementation", "verdicts"]].values.tolist() == [["cross_ws_replicated", "ddp", 1]]


def test_the_plain_model_failing_a_scenario_is_a_model_limit_not_a_false_alarm():
    """A BatchNorm model under the bf16 policy: the plain run itself raises, and its verdict says that no
    implementation is involved. Counted apart; any other failure, the reference's own included, is an alarm."""
    from harness.core.scenario import Scenario
    from harness.core.verdict import FAIL, Verdict
    from harness.tables.build import model_limit
    from suites.mutants.false_alarms import FalseAlarmRun

    ref = Scenario("reference", "bn_mlp", 1, "replicated", "adamw", feature="bf16")
    impl = Scenario("fsdp_impl", "bn_mlp", 2, "replicated", "adamw", feature="bf16")
    _, said = model_limit(ref, "error", "Traceback ...\nRuntimeError: expected scalar type BFloat16", {})
    verdicts = [
        Verdict("completed", ref.id, FAIL, None, None, message=said),
        Verdict("converges", ref.id, FAIL, None, None, message="the loss rose"),
        Verdict("completed", impl.id, FAIL, None, None, message=said),
    ]  # an implementation's run: an alarm
    run = FalseAlarmRun(0, [ref, impl], verdicts, 1.0)
    assert [(v.scenario, v.check) for v in run.model_limits] == [(ref.id, "completed")]
    assert [(v.scenario, v.check) for v in run.false_alarms] == [(ref.id, "converges"), (impl.id, "completed")]


def test_a_saved_sweep_resumes_where_it_stopped_and_refuses_another_matrix(tmp_path, monkeypatch):
    """Each model's verdicts are saved as it finishes; a second sweep reads them back (the same verdicts,
    nothing run again) and runs only the models not saved; a file of another matrix is refused."""
    from harness.core.scenario import Scenario
    from harness.core.verdict import FAIL, PASS, Verdict
    from suites.mutants import false_alarms as fa

    def cells(seed, models):
        return [Scenario("fsdp_impl", m, w, "replicated", "adamw", seed=seed) for m in models for w in (1, 2)]

    ran = []

    def fake_run(scenarios, *, seed, pool=None, progress=None, journal=None):
        ran.append(scenarios[0].model)
        verdicts = [
            Verdict(
                "cross_ws_replicated",
                c.id,
                FAIL if c.world_size == 2 else PASS,
                1.5e-7 * c.world_size,
                3e-8,
                step=1,
                param="fc.weight",
            )
            for c in scenarios
        ]
        return fa.FalseAlarmRun(seed, scenarios, verdicts, 2.0)

    monkeypatch.setattr(fa, "full_matrix", cells)
    monkeypatch.setattr(fa, "run_false_alarms", fake_run)
    first = fa.run_saved(4, ["mlp"], tmp_path)
    assert ran == ["mlp"] and sorted(p.name for p in tmp_path.iterdir()) == ["seed4-mlp.json.gz"]
    both = fa.run_saved(4, ["mlp", "hf:gpt2"], tmp_path)
    assert ran == ["mlp", "hf:gpt2"], "the saved model ran again"
    assert both.verdicts[:2] == first.verdicts and len(both.false_alarms) == 2 and not both.unjudged
    assert (tmp_path / "seed4-hf_gpt2.json.gz").exists()
    import torch

    # each part says where it ran: a resumed sweep's parts may come from different machines
    assert len(both.origins) == 2 and all(f"torch {torch.__version__}" in o for o in both.origins)
    assert both.origins[0].startswith("seed 4, mlp: commit ") and both.origins[1].startswith("seed 4, hf:gpt2:")
    # a part saved as plain JSON, as the first sweeps saved them, is read back as well
    import gzip

    with gzip.open(tmp_path / "seed4-mlp.json.gz", "rt") as f:
        (tmp_path / "seed5-mlp.json").write_text(f.read().replace('"seed": 4', '"seed": 5'))
    monkeypatch.setattr(fa, "full_matrix", lambda seed, models: cells(4, models))
    assert fa.run_saved(5, ["mlp"], tmp_path).verdicts == first.verdicts and ran == ["mlp", "hf:gpt2"]
    monkeypatch.setattr(fa, "full_matrix", lambda seed, models: cells(seed, models)[:1])
    with pytest.raises(SystemExit, match="another matrix"):
        fa.run_saved(4, ["mlp"], tmp_path)
    # a part half run by other code (its journal, harness.execute.journal) is refused, not mixed in
    from harness.execute.journal import Journal

    Journal(fa.unfinished_dir(tmp_path, 6, "mlp"), "0000000 + changes")
    with pytest.raises(SystemExit, match="was started by '0000000 \\+ changes'"):
        fa.run_saved(6, ["mlp"], tmp_path)
    assert ran == ["mlp", "hf:gpt2"]


def test_a_saved_sweep_runs_its_missing_parts_n_at_a_time_and_names_a_failing_one(tmp_path, monkeypatch):
    """--sweep-jobs: the parts not yet saved run `jobs` at a time, each in a process of its own; a saved part
    is not run again; a part that fails stops the sweep with its name and its log."""
    import sys

    from suites.mutants import false_alarms as fa

    # a stand-in part: marks itself running, waits (up to 5 s) to see a second part running, saves a file where
    # the real one would be (or fails)
    code = (
        "import sys, time, pathlib; seed, model, d = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]); "
        "print('part', seed, model); sys.exit(3) if model == 'broken' else None\n"
        "mark = d / f'running-{seed}-{model}'; mark.touch(); end = time.time() + 5; peak = 0\n"
        "while peak < 2 and time.time() < end:\n"
        "    peak = max(peak, len(list(d.glob('running-*')))); time.sleep(0.02)\n"
        "(d / f'peak-{seed}-{model}').write_text(str(peak)); mark.unlink()\n"
        "(d / f'seed{seed}-{model}.json.gz').write_text('{}')"
    )
    monkeypatch.setattr(
        fa, "part_command", lambda seed, model, d: [sys.executable, "-c", code, str(seed), model, str(d)]
    )
    for saved in (
        "seed0-a.json.gz",
        "seed1-c.json",
    ):  # saved before (gzipped, or as the first sweeps did): not run again
        (tmp_path / saved).write_text("{}")
    fa.run_parts([0, 1], ["a", "b", "c"], tmp_path, jobs=2, poll_s=0.05)
    assert {p.name.split(".")[0] for p in tmp_path.glob("seed*.json*")} == {
        f"seed{s}-{m}" for s in (0, 1) for m in "abc"
    }
    assert sorted(p.name for p in tmp_path.glob("peak-*")) == ["peak-0-b", "peak-0-c", "peak-1-a", "peak-1-b"]
    # two at a time, no more (the last part may find itself alone: which part ends first is the scheduler's)
    peaks = [int(p.read_text()) for p in sorted(tmp_path.glob("peak-*"))]
    assert max(peaks) == 2 and peaks.count(2) >= 2, peaks
    assert (tmp_path / "log-seed1-a.txt").read_text() == "part 1 a\n"
    with pytest.raises(SystemExit, match=r"part seed 2, broken failed \(exit 3\); its log: .*log-seed2-broken.txt"):
        fa.run_parts([2], ["broken"], tmp_path, jobs=2, poll_s=0.05)


def test_sweep_jobs_without_a_sweep_dir_is_a_usage_error(capsys):
    from reports.mutation_score import main

    with pytest.raises(SystemExit) as e:
        main(["--sweep-jobs", "4", "--false-alarm-seeds", "0"])
    assert e.value.code == 2 and "give --sweep-dir DIR too" in capsys.readouterr().err
