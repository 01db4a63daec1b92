"""Faults: a rank that raises, dies, hangs or produces NaN, and what the run says about it.

One small matrix (mlp, 3 steps, world size 2, replicated data) runs every fault adapter of
``fault_adapters`` once through ``harness.phases.run_matrix``, between good scenarios, with a short
scenario timeout; the tests below read that one run (the module-scoped ``fault_run``: its worlds
start once for all of them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.execute.world import World, WorldPool
from harness.phases import run_matrix
from suites.faults.fault_adapters import FAULT_STEP, NAN_PARAM_STEP
from suites.faults.processes import ENV, ROOT, stat_of, wait_all_dead
from suites.faults.scenarios import FA, STEPS, scenario

# the CI tier (--ci; .ci/run runs it): worlds broken, killed, timed out and rebuilt (a 10 s hang among them)
pytestmark = pytest.mark.ci

HANG_TIMEOUT_S = 10.0  # the run's --scenario-timeout; a good scenario here takes ~1 s
# name -> (faulty rank, phase as the exception names it, harness code of the phase, raising function, step)
RAISES = {
    "init_rank1": (1, "init (wrap)", "adapter.wrap(", "raise_in_init", 0),
    "forward_rank1": (1, "forward", "model(xm)", "raise_in_forward", FAULT_STEP),
    "backward_rank0": (0, "backward", "loss.backward()", "raise_in_backward", FAULT_STEP),
    "step_rank1": (1, "optimizer step", "optimizer.step()", "raise_in_optimizer_step", FAULT_STEP),
    "adapter_rank1": (1, "full_params", "adapter.full_params(", "raise_in_full_params", FAULT_STEP),
}
BREAKING = [*RAISES, "crash_rank1", "hang_rank1"]  # each leaves its world unusable
NAN = ["nan_loss", "nan_param"]
DIFF_CHECKS = ("ws1_exact", "cross_ws_replicated", "split_matches_full_batch")

GOOD_FIRST = scenario("fsdp_impl", 2, "adamw")  # runs before the faults, in the first world of 2
GOOD_LAST = scenario("fsdp_impl", 2, "sgd")  # runs after all of them


# -- the fault run --------------------------------------------------------------------------------


class RecordingPool(WorldPool):
    """A WorldPool that remembers every world it started (their pids and whether they broke)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.started: list[World] = []

    def get(self, world_size: int, backend: str = "gloo", lane: int = 0) -> World:
        world = super().get(world_size, backend, lane)
        if not any(w is world for w in self.started):
            self.started.append(world)
        return world


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    # start the forkserver (it imports torch: seconds) outside the short timeout of the run
    with World(1, timeout_s=300) as warm:
        warm.call(f"{FA}:warm_up")
    scenarios = [
        scenario("reference", 1),
        scenario("fsdp_impl", 1),
        scenario("reference", 1, "sgd"),
        scenario("fsdp_impl", 1, "sgd"),
        GOOD_FIRST,
        *[scenario(name) for name in BREAKING + NAN],
        GOOD_LAST,
    ]
    seconds: dict[str, float] = {}
    pool = RecordingPool(timeout_s=HANG_TIMEOUT_S)
    try:
        res = run_matrix(
            scenarios,
            pool=pool,
            timeout_s=HANG_TIMEOUT_S,
            progress=lambda i, n, sc, secs: seconds.__setitem__(sc.id, secs),
        )
    finally:
        pool.close()
    from harness.report.markdown import write_report

    # the NaN scenarios are left out of this report: they crash the writer (see test_a_nan_run_...)
    nan_ids = {scenario(name).id for name in NAN}
    tables = {k: t[~t["scenario"].isin(nan_ids)] if "scenario" in t else t for k, t in res.tables.items()}
    report = write_report(tables, res.env, tmp_path_factory.mktemp("faults") / "faults.md")
    return SimpleNamespace(
        result=res,
        pool=pool,
        seconds=seconds,
        report=report.read_text(),
        pids=[pid for world in pool.started for pid in world.pids],
    )


def verdicts_of(res, sid: str) -> list:
    return [v for v in res.verdicts if v.scenario == sid]


def completed_failure(res, sid: str):
    """The 'completed' verdict of a scenario that did not finish (exactly one, failed)."""
    found = [v for v in verdicts_of(res, sid) if v.check == "completed"]
    assert len(found) == 1, f"{sid}: expected one 'completed' verdict, got {found}"
    assert found[0].status == "fail"
    return found[0]


def sections(message: str) -> dict[int, str]:
    """A hang message split into rank -> the block under '--- rank N (pid P) was waiting here ---'."""
    parts = re.split(r"^--- rank (\d+) \(pid \d+\) was waiting here ---$", message, flags=re.M)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("name", list(RAISES))
def test_a_raising_rank_fails_its_scenario_with_its_rank_and_traceback(fault_run, name):
    rank, phase, harness_code, raiser, step = RAISES[name]
    sid = scenario(name).id
    v = completed_failure(fault_run.result, sid)
    assert v.rank == rank  # the rank it started on, as a field
    message = v.message
    first = message.splitlines()[0]
    assert re.fullmatch(rf"rank {rank} of World\(2\b.*\) failed in harness\.train\.task:train_scenario:", first), first
    assert f"rank {1 - rank} of World" not in message  # the peer that only waited is not blamed
    assert "Traceback (most recent call last)" in message
    assert "harness/train/task.py" in message and harness_code in message  # where in the training step
    assert raiser in message and "fault_adapters.py" in message  # the user code that raised
    exc_line = f"FaultInjected: injected fault in {phase} on rank {rank} at step {step}"
    assert exc_line in message
    assert exc_line in str(v)  # what test_equivalence's assertion prints
    assert exc_line in fault_run.report and first in fault_run.report  # what the report shows


def test_a_rank_that_dies_is_named_with_its_exit_code(fault_run):
    v = completed_failure(fault_run.result, scenario("crash_rank1").id)
    assert v.rank == 1 and "died (exit code 9)" in v.message


def test_the_failure_leads_with_the_rank_that_died_not_its_peer(fault_run):
    v = completed_failure(fault_run.result, scenario("crash_rank1").id)
    assert v.rank == 1
    assert v.message.splitlines()[0].startswith("rank 1 ")


def test_a_hang_times_out_and_says_which_ranks_waited_where(fault_run):
    sid = scenario("hang_rank1").id
    v = completed_failure(fault_run.result, sid)
    message = v.message
    assert "hung in harness.train.task:train_scenario: ranks [] answered, ranks [0, 1] did not" in message
    stacks = sections(message)
    assert set(stacks) == {0, 1}, message
    # rank 1 waits in the all_reduce that rank 0 skipped ...
    assert "hang_in_skipped_collective" in stacks[1] and "in all_reduce" in stacks[1]
    # ... and rank 0 in its next collective of the training step, waiting for rank 1
    assert "harness/train/task.py" in stacks[0] and "distributed_c10d.py" in stacks[0]
    assert "hang_in_skipped_collective" not in stacks[0]
    assert HANG_TIMEOUT_S <= fault_run.seconds[sid] < HANG_TIMEOUT_S + 20


def test_the_other_scenarios_still_complete_and_pass(fault_run):
    res = fault_run.result
    status = dict(zip(res.tables["scenarios"].scenario, res.tables["scenarios"].status))
    assert all(status[scenario(name).id] == "error" for name in BREAKING)
    assert all(status[scenario(name).id] == "ok" for name in NAN)
    good = [GOOD_FIRST, GOOD_LAST] + [s for s in res.scenarios if s.world_size == 1]
    for sc in good:
        assert status[sc.id] == "ok", sc.id
        failed = [str(v) for v in verdicts_of(res, sc.id) if v.status == "fail"]
        assert not failed, "\n".join(failed)
    for sc in (GOOD_FIRST, GOOD_LAST):  # really compared with world size 1, not skipped
        cross = [v for v in verdicts_of(res, sc.id) if v.check == "cross_ws_replicated"]
        assert [v.status for v in cross] == ["pass"]


def test_the_world_is_rebuilt_after_each_broken_scenario(fault_run):
    pool = fault_run.pool
    twos = [w for w in pool.started if w.world_size == 2]
    ones = [w for w in pool.started if w.world_size == 1]  # side by side where there are cores for them
    assert 1 <= len(ones) <= 4 and not any(w.broken for w in ones)
    # the worlds of 1, the first world of 2, one more per break
    assert pool.worlds_started == len(ones) + 1 + len(BREAKING)
    assert len(twos) == 1 + len(BREAKING)
    assert all(w.broken for w in twos[:-1]) and not twos[-1].broken  # the last one closed cleanly
    assert len({pid for w in twos for pid in w.pids}) == 2 * len(twos)  # fresh processes every time


def test_no_worker_process_survives_the_run(fault_run):
    ones = sum(w.world_size == 1 for w in fault_run.pool.started)
    assert len(fault_run.pids) == ones + 2 * (1 + len(BREAKING))
    assert wait_all_dead(fault_run.pids, 10) == []
    workers = {str(p) for p in fault_run.pids}
    started_by_workers = [
        int(n) for n in os.listdir("/proc") if n.isdigit() and (stat_of(int(n)) or [None] * 3)[2] in workers
    ]
    assert started_by_workers == []


@pytest.mark.parametrize("name", NAN)
def test_nan_is_a_failed_finite_verdict_never_a_passed_diff(fault_run, name):
    res = fault_run.result
    sid = scenario(name).id
    losses = res.tables["steps"].query("scenario == @sid").sort_values("step").loss.tolist()
    assert len(losses) == STEPS
    nan_step = FAULT_STEP if name == "nan_loss" else NAN_PARAM_STEP  # parameters are NaN after it
    assert all(x == x for x in losses[:nan_step])  # finite until the NaN reaches the loss
    if name == "nan_loss":
        assert losses[nan_step] != losses[nan_step]  # NaN loss at the next step
    finite = [v for v in verdicts_of(res, sid) if v.check == "finite"]
    assert [v.status for v in finite] == ["fail"]
    # the verdict names the first step a NaN shows: the parameters updated with a NaN gradient at
    # nan_step (the loss turns NaN only at the step after, or never for nan_param)
    assert finite[0].step == nan_step and finite[0].param.startswith("layers."), str(finite[0])
    assert not [v for v in verdicts_of(res, sid) if v.check in DIFF_CHECKS and v.status == "pass"]
    assert any(not v.passed for v in verdicts_of(res, sid))  # the scenario's test fails


def test_a_nan_run_through_the_cli_fails_finite_and_still_writes_the_report(tmp_path):
    report = tmp_path / "r.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1",
            "--models",
            "mlp",
            "--impl",
            f"{FA}:nan_loss",
            "--data-modes",
            "replicated",
            "--optimizers",
            "adamw",
            "--steps",
            "3",
            "--report",
            str(report),
            "--quiet",
            "--no-plots",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    assert proc.returncode == 1
    nan_id = scenario("nan_loss", 1).id
    # the first NaN: the parameters updated with the NaN gradient of step FAULT_STEP
    assert f"[FAIL] finite {nan_id} at step {FAULT_STEP}, layers." in proc.stderr, proc.stderr
    assert report.exists() and "finite" in report.read_text()
    # --no-plots through the CLI: the report says where each plot would be, its plots folder is empty
    text = report.read_text()
    assert ": not drawn (--no-plots)._" in text and "](r_plots/" not in text, text
    assert list((tmp_path / "r_plots").iterdir()) == []


def test_a_failed_scenario_does_not_poison_the_next_one_in_the_same_process(tmp_path):
    with World(1, timeout_s=120) as world:
        [out] = world.call(f"{FA}:scenario_after_fault", str(tmp_path))
    assert out["faulty"] == "FaultInjected: injected fault in forward on rank 0 at step 2"
    assert out["next"] == "ok"


def test_an_adapter_that_raises_in_every_scenario_fails_the_cli_naming_the_error(tmp_path):
    """Exit 1 (FAIL), never 3 (NOT RUN, which a CI job may read as 'skipped'), with the error on the last line."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--world-sizes",
            "1",
            "--models",
            "mlp",
            "--impl",
            f"{FA}:forward_rank0",
            "--optimizers",
            "adamw",
            "--steps",
            "3",
            "--no-report",
            "--quiet",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr
    assert last.startswith("FAIL: ") and f"{FA}:forward_rank0: 0 ran, 0 unsupported, 2 errored (first: " in last, last
    assert f"injected fault in forward on rank 0 at step {FAULT_STEP})" in last, last
