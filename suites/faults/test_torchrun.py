"""The matrix under torchrun: a real 2-rank job that fails its faulty scenarios and goes on, a
job too small for the world sizes asked, and the CLI smoke run that writes one report.
"""

from __future__ import annotations

import csv
import json
import re
import sys

import pytest

from harness.phases import run_matrix
from suites.faults.processes import kill_session, start, wait_all_dead, wait_session_empty
from suites.faults.scenarios import FA, scenario

# the CI tier (--ci; .ci/run runs it): real torchrun jobs, each a CLI or matrix run of its own
pytestmark = pytest.mark.ci

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def test_under_torchrun_the_matrix_runs_fails_faults_and_goes_on(tmp_path, kept_worlds):
    """run_matrix_under_torchrun in a real 2-rank torchrun job (--standalone: no fixed port)."""
    out = tmp_path / "out.json"
    specs = [
        "reference@1",
        "fsdp_impl@1",
        "fsdp_impl@2",
        "forward_rank1_step3@2",
        "suites.harness.unit.example_adapter:adapter@1",
        "suites.harness.unit.example_adapter:adapter@2",
        "hang_rank1@2",
    ]
    proc = start([*TORCHRUN, "-m", FA, str(out), "4", *specs])
    try:
        stdout, stderr = proc.communicate(timeout=300)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid-rank*")]
        assert len(pids) == 2
        assert out.exists(), stdout + stderr
        got = json.loads(out.read_text())
        status, error = got["status"], got["error"]
        fwd, hang = scenario("forward_rank1_step3").id, scenario("hang_rank1").id
        example = "suites.harness.unit.example_adapter.adapter-mlp-ws2-replicated-adamw"
        assert [
            status[s]
            for s in ("reference-mlp-ws1-replicated-adamw", "fsdp_impl-mlp-ws2-replicated-adamw", fwd, example, hang)
        ] == ["ok", "ok", "error", "ok", "error"]
        # a raising rank: named, with its traceback; rank 0 only waited for it
        assert error[fwd].startswith(f"rank 1 of torchrun ranks 0..1 (job of 2) failed in {fwd}:")
        assert "raise_in_forward" in error[fwd]
        assert "FaultInjected: injected fault in forward on rank 1 at step 3" in error[fwd]
        # the scenario after it ran on a rebuilt subgroup and passed every check
        assert not [v for v in got["verdicts"] if v["scenario"] == example and v["status"] == "fail"]
        assert got["groups_built"] == 3  # ranks {0}, ranks {0, 1}, ranks {0, 1} again after the failure
        # a hang: which rank did not answer, and where it was waiting
        assert "hung in" in error[hang] and "ranks [1] did not" in error[hang]
        waiting = error[hang].split("--- rank 1 was waiting here ---")[1]
        assert "hang_in_skipped_collective" in waiting and "all_reduce" in waiting
        # bitwise the same numbers as the same scenarios in process worlds
        same = [scenario("reference", 1), scenario("fsdp_impl", 1), scenario("fsdp_impl", 2)]
        local = run_matrix(same, pool=kept_worlds).tables["steps"]
        cols = ["scenario", "step", "loss", "grad_norm", "max_diff_ref", "max_diff_ws1"]
        ids = {sc.id for sc in same}
        assert _no_nan([r for r in got["steps"] if r["scenario"] in ids]) == _no_nan(local[cols].to_dict("records"))
        # the stuck rank ends once rank 0 is done (its collective fails when rank 0 exits, or its
        # watchdog ends it): nothing is left
        assert wait_all_dead(pids, 10) == [] and wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)


def _no_nan(rows: list[dict]) -> list[dict]:
    """NaN (no comparison made, e.g. the reference against world size 1) as None, so == works."""
    return [{k: None if isinstance(v, float) and v != v else v for k, v in r.items()} for r in rows]


def test_under_torchrun_a_scenario_larger_than_the_job_is_one_clear_error(monkeypatch):
    from harness.execute.torchrun import TorchrunUsageError
    from harness.phases import run_matrix_under_torchrun

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(TorchrunUsageError) as info:  # raised before any rendezvous
        run_matrix_under_torchrun([scenario("fsdp_impl", 1), scenario("fsdp_impl", 4)], timeout_s=5)
    assert str(info.value) == (
        "--world-sizes: 4 need more ranks than torchrun started (2); "
        "launch at least 4 (e.g. --nproc_per_node=4) or drop them"
    )


@pytest.mark.parametrize(
    "bad, error",
    [
        (
            ["--world-sizes", "1,2,4"],
            "error: --world-sizes: 4 need more ranks than torchrun started (2); launch at least "
            "4 (e.g. --nproc_per_node=4) or drop them",
        ),
        # an argparse error, said the same way (the slow tier's: the case above already holds the once-by-rank-0 rule)
        pytest.param(
            ["--world-sizes", "1,x"], "python -m harness run: error: argument --world-sizes: ", marks=pytest.mark.slow
        ),
    ],
    ids=["larger-than-the-job", "not-a-number"],
)
def test_under_torchrun_a_usage_error_is_said_once_by_rank_0_before_anything_runs(tmp_path, bad, error):
    """Every rank meets it; rank 0 alone says it and exits 2 (EXIT_USAGE), the other ranks wait
    silently until torchrun stops them. What torchrun itself prints of a failed job (its log lines,
    its ChildFailedError traceback and summary, its own exit status 1) is not the harness's to change."""
    report = tmp_path / "r.md"
    proc = start(
        [*TORCHRUN, "-m", "harness", "run", *bad, "--impl", "fsdp_impl", "--models", "mlp", "--report", str(report)]
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
        ours = [line for line in stderr.splitlines() if "error:" in line and "Error" not in line]
        assert len(ours) == 1 and ours[0].startswith(error), stderr
        assert not re.search(r"^(running|rank \d+:) ", stderr, flags=re.M), stderr
        # torchrun's summary: rank 0 is the root cause, with the harness's usage status
        root_cause = stderr.partition("Root Cause")[2]
        assert re.search(r"rank\s+: 0 \(local_rank: 0\)\n\s+exitcode\s+: 2 ", root_cause), stderr
        assert proc.returncode != 0 and not report.exists()
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)


def test_torchrun_cli_smoke_writes_one_report_from_rank_0(tmp_path):
    """Also the features that make groups (hsdp: every rank of the job makes them, in one order) and
    that order runs (ckpt: resumed runs after their savers)."""
    report = tmp_path / "r.md"
    proc = start(
        [
            *TORCHRUN,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1,2",
            "--impl",
            "fsdp_impl",
            "--models",
            "mlp",
            "--optimizers",
            "adamw",
            "--steps",
            "3",
            "--features",
            "plain,hsdp,ckpt",
            "--report",
            str(report),
            "--no-plots",
        ]
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout + stderr
        assert report.exists()
        ran = {
            row["scenario"]: row["status"] for row in csv.DictReader((tmp_path / "r_tables" / "scenarios.csv").open())
        }
        for sid in (
            "fsdp_impl-mlp-ws2-replicated-adamw",
            "fsdp_impl-mlp-ws2-split-adamw-hsdp",
            "fsdp_impl-mlp-ws1-split-adamw-ckpt-from2",
        ):
            assert ran.get(sid) == "ok", (sid, ran)
        # one job, one run: the summary comes from rank 0 only
        assert len(re.findall(r"^PASS: \d+ passed, \d+ failed", stderr, flags=re.M)) == 1, stderr
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)
