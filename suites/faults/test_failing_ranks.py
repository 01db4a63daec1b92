"""Faults: a rank that raises, dies, hangs or produces NaN; Ctrl-C; bad input; torchrun.

One small matrix (mlp, 3 steps, world size 2, replicated data) runs every fault adapter of
``fault_adapters`` once through ``harness.execute.executor.run_matrix``, between good scenarios, with a short
scenario timeout; the tests below read that one run. The subprocess tests (Ctrl-C, bad input,
torchrun) start the CLI / pytest / torchrun in a session of their own and look for survivors by
session id in /proc.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.core.scenario import Scenario
from harness.execute.executor import run_matrix
from harness.execute.world import World, WorldPool
from suites.faults import bad_inputs
from suites.faults.fault_adapters import FAULT_STEP, NAN_PARAM_STEP

ROOT = Path(__file__).resolve().parents[2]
FA = "suites.faults.fault_adapters"
STEPS = 3
HANG_TIMEOUT_S = 10.0  # the run's --scenario-timeout; a good scenario here takes ~1 s
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
# name -> (faulty rank, phase as the exception names it, harness code of the phase, raising function, step)
RAISES = {
    "init_rank1": (1, "init (wrap)", "adapter.wrap(", "raise_in_init", 0),
    "forward_rank1": (1, "forward", "wrapped(x)", "raise_in_forward", FAULT_STEP),
    "backward_rank0": (0, "backward", "loss.backward()", "raise_in_backward", FAULT_STEP),
    "step_rank1": (1, "optimizer step", "optimizer.step()", "raise_in_optimizer_step", FAULT_STEP),
    "adapter_rank1": (1, "full_params", "adapter.full_params(", "raise_in_full_params", FAULT_STEP),
}
BREAKING = [*RAISES, "crash_rank1", "hang_rank1"]  # each leaves its world unusable
NAN = ["nan_loss", "nan_param"]
DIFF_CHECKS = ("ws1_exact", "cross_ws_replicated", "split_matches_full_batch")


def scenario(impl: str, world_size: int = 2, optimizer: str = "adamw") -> Scenario:
    impl = impl if impl in ("reference", "fsdp_impl") else f"{FA}:{impl}"
    return Scenario(impl, "mlp", world_size, "replicated", optimizer, steps=STEPS)


GOOD_FIRST = scenario("fsdp_impl", 2, "adamw")  # runs before the faults, in the first world of 2
GOOD_LAST = scenario("fsdp_impl", 2, "sgd")  # runs after all of them


# -- processes ------------------------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Running: a zombie counts as dead (its parent may just not have reaped it yet)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def wait_all_dead(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def in_session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a subprocess started with start_new_session=True and
    everything it started that did not leave the session: forkservers, workers, torchrun ranks)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[0] != "Z" and int(st[3]) == sid:
                out.append(int(name))
    return out


def wait_session_empty(sid: int, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while in_session(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return in_session(sid)


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def kill_session(proc: subprocess.Popen) -> None:
    """Last resort in a finally: whatever the test left of the session it started."""
    if in_session(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# -- the fault run --------------------------------------------------------------------------------

class RecordingPool(WorldPool):
    """A WorldPool that remembers every world it started (their pids and whether they broke)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.started: list[World] = []

    def get(self, world_size: int, backend: str = "gloo") -> World:
        world = super().get(world_size, backend)
        if not any(w is world for w in self.started):
            self.started.append(world)
        return world


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    # start the forkserver (it imports torch: seconds) outside the short timeout of the run
    with World(1, timeout_s=300) as warm:
        warm.run(f"{FA}:warm_up")
    scenarios = [scenario("reference", 1), scenario("fsdp_impl", 1),
                 scenario("reference", 1, "sgd"), scenario("fsdp_impl", 1, "sgd"),
                 GOOD_FIRST, *[scenario(name) for name in BREAKING + NAN], GOOD_LAST]
    seconds: dict[str, float] = {}
    pool = RecordingPool(timeout_s=HANG_TIMEOUT_S)
    try:
        res = run_matrix(scenarios, pool=pool, timeout_s=HANG_TIMEOUT_S,
                         progress=lambda i, n, sc, secs: seconds.__setitem__(sc.id, secs))
    finally:
        pool.close()
    from harness.report.markdown import write_report
    # the NaN scenarios are left out of this report: they crash the writer (see test_a_nan_run_...)
    nan_ids = {scenario(name).id for name in NAN}
    tables = {k: t[~t["scenario"].isin(nan_ids)] if "scenario" in t else t for k, t in res.tables.items()}
    report = write_report(tables, res.env, tmp_path_factory.mktemp("faults") / "faults.md")
    return SimpleNamespace(result=res, pool=pool, seconds=seconds, report=report.read_text(),
                           pids=[pid for world in pool.started for pid in world.pids])


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
    assert re.fullmatch(rf"rank {rank} of World\(2\b.*\) failed in harness\.train\.task:run_scenario:", first), first
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
    assert "rank 1 died (exit code 9)" in v.message


def test_the_failure_leads_with_the_rank_that_died_not_its_peer(fault_run):
    v = completed_failure(fault_run.result, scenario("crash_rank1").id)
    assert v.rank == 1
    assert v.message.splitlines()[0].startswith("rank 1 ")


def test_a_hang_times_out_and_says_which_ranks_waited_where(fault_run):
    sid = scenario("hang_rank1").id
    v = completed_failure(fault_run.result, sid)
    message = v.message
    assert "hung in harness.train.task:run_scenario: ranks [] answered, ranks [0, 1] did not" in message
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
    assert pool.worlds_started == 1 + 1 + len(BREAKING)  # world of 1, first world of 2, one per break
    assert len(twos) == 1 + len(BREAKING)
    assert all(w.broken for w in twos[:-1]) and not twos[-1].broken  # the last one closed cleanly
    assert len({pid for w in twos for pid in w.pids}) == 2 * len(twos)  # fresh processes every time


def test_no_worker_process_survives_the_run(fault_run):
    assert len(fault_run.pids) == 1 + 2 * (1 + len(BREAKING))
    assert wait_all_dead(fault_run.pids, 10) == []
    workers = {str(p) for p in fault_run.pids}
    started_by_workers = [int(n) for n in os.listdir("/proc")
                          if n.isdigit() and (_stat(int(n)) or [None] * 3)[2] in workers]
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
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--world-sizes", "1", "--models", "mlp",
                           "--impl", f"{FA}:nan_loss", "--data-modes", "replicated", "--optimizers", "adamw",
                           "--steps", "3", "--report", str(report), "--quiet"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    assert proc.returncode == 1
    nan_id = scenario("nan_loss", 1).id
    # the first NaN: the parameters updated with the NaN gradient of step FAULT_STEP
    assert f"[FAIL] finite {nan_id} at step {FAULT_STEP}, layers." in proc.stderr, proc.stderr
    assert report.exists() and "finite" in report.read_text()


def test_a_failed_scenario_does_not_poison_the_next_one_in_the_same_process(tmp_path):
    with World(1, timeout_s=120) as world:
        [out] = world.run(f"{FA}:scenario_after_fault", str(tmp_path))
    assert out["faulty"] == "FaultInjected: injected fault in forward on rank 0 at step 2"
    assert out["next"] == "ok"


# -- Ctrl-C ---------------------------------------------------------------------------------------

def _interrupt_when(proc: subprocess.Popen, ready, within_s: float = 120) -> int:
    """Wait until ``ready(forkserver processes)``, then Ctrl-C the session as a terminal would
    (SIGINT to the whole foreground process group); returns the count just before."""
    deadline = time.monotonic() + within_s
    count = 0
    while time.monotonic() < deadline and proc.poll() is None:
        count = _forkserver_processes(in_session(proc.pid))
        if ready(count):
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"exited early ({proc.returncode}): {proc.communicate()}"
    os.killpg(proc.pid, signal.SIGINT)
    return count


def test_ctrl_c_of_the_cli_exits_non_zero_with_one_line_and_no_orphans(tmp_path):
    # rank 1 hangs with a timeout far away: the world of 2 is certainly mid-run at the Ctrl-C
    proc = start([sys.executable, "-m", "harness", "run", "--world-sizes", "1,2", "--models", "mlp",
                  "--impl", f"{FA}:hang_rank1", "--data-modes", "replicated", "--optimizers", "adamw",
                  "--steps", "3", "--scenario-timeout", "600", "--report", str(tmp_path / "r.md")])
    try:
        # the forkserver and the 2 workers of the world of 2 (the world of 1 had 1)
        assert _interrupt_when(proc, lambda n: n >= 3) >= 3
        out, err = proc.communicate(timeout=60)
        assert proc.returncode not in (0, None)
        assert "Traceback" not in err + out
        tail = [line for line in err.splitlines() if not line.startswith(("running ", "["))]
        assert tail == ["interrupted"], err
        assert wait_session_empty(proc.pid, 10) == []
        assert not (tmp_path / "r.md").exists()  # no half-written report
    finally:
        kill_session(proc)


def _forkserver_processes(pids: list[int]) -> int:
    """How many of ``pids`` run multiprocessing's forkserver code: each forkserver and every world
    worker forked from it (they keep its command line)."""
    return sum(1 for p in pids if b"multiprocessing.forkserver" in _cmdline(p))


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_ctrl_c_of_a_pytest_xdist_run_leaves_no_orphans(tmp_path):
    proc = start([sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider",
                  "suites/test_equivalence.py", "--world-sizes", "1,2", "--models", "mlp",
                  "--impl", f"{FA}:hang_rank1", "--data-modes", "replicated", "--optimizers", "adamw",
                  "--steps", "3", "--scenario-timeout", "600", "--report", str(tmp_path / "r.md")])
    try:
        # the matrix runs once, in one xdist worker: its forkserver and the hanging world of 2
        assert _interrupt_when(proc, lambda n: n >= 3, within_s=180) >= 3
        proc.communicate(timeout=90)
        assert proc.returncode not in (0, None)
        assert wait_session_empty(proc.pid, 15) == []
    finally:
        kill_session(proc)


# -- bad input ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_input_outcomes():
    return {(o.case, o.mode): o for o in bad_inputs.probe_all()}


def _bad_input_params():
    for case in bad_inputs.CASES:
        for mode in ("cli", "pytest") if case.pytest else ("cli",):
            yield pytest.param(case, mode, id=f"{mode}-" + re.sub(r"\W+", "_", case.what).strip("_"))


@pytest.mark.parametrize("case, mode", list(_bad_input_params()))
def test_bad_input_gets_one_clear_line_and_a_usage_exit(bad_input_outcomes, case, mode):
    o = bad_input_outcomes[(case, mode)]
    expected_rc = bad_inputs.CLI_USAGE_EXIT if mode == "cli" else bad_inputs.PYTEST_USAGE_EXIT
    assert not o.traceback, o.output
    assert o.rc == expected_rc, o.output
    assert len(o.lines) == 1, o.output
    assert case.expect in o.lines[0]
    if mode == "pytest" and ": error: " in o.lines[0]:  # argparse names the command the user typed
        assert o.lines[0].startswith("python -m pytest: error: "), o.lines[0]


def test_the_bad_input_table_lists_every_case():
    text = bad_inputs.TABLE.read_text()
    for case in bad_inputs.CASES:
        assert f"| {case.what}" in text, f"{case.what}: rerun python -m suites.faults.bad_inputs"


# -- torchrun -------------------------------------------------------------------------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def test_under_torchrun_the_matrix_runs_fails_faults_and_goes_on(tmp_path):
    """run_matrix_under_torchrun in a real 2-rank torchrun job (--standalone: no fixed port)."""
    out = tmp_path / "out.json"
    specs = ["reference@1", "fsdp_impl@1", "fsdp_impl@2", "forward_rank1_step3@2",
             "suites.unit.example_adapter:adapter@1", "suites.unit.example_adapter:adapter@2", "hang_rank1@2"]
    proc = start([*TORCHRUN, "-m", FA, str(out), "4", *specs])
    try:
        stdout, stderr = proc.communicate(timeout=300)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid-rank*")]
        assert len(pids) == 2
        assert out.exists(), stdout + stderr
        got = json.loads(out.read_text())
        status, error = got["status"], got["error"]
        fwd, hang = scenario("forward_rank1_step3").id, scenario("hang_rank1").id
        example = "suites.unit.example_adapter.adapter-mlp-ws2-replicated-adamw"
        assert [status[s] for s in ("reference-mlp-ws1-replicated-adamw", "fsdp_impl-mlp-ws2-replicated-adamw",
                                    fwd, example, hang)] == ["ok", "ok", "error", "ok", "error"]
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
        local = run_matrix(same, timeout_s=120).tables["steps"]
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
    from harness.execute.torchrun import TorchrunUsageError, run_matrix_under_torchrun

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(TorchrunUsageError) as info:  # raised before any rendezvous
        run_matrix_under_torchrun([scenario("fsdp_impl", 1), scenario("fsdp_impl", 4)], timeout_s=5)
    assert str(info.value) == ("--world-sizes: 4 need more ranks than torchrun started (2); "
                               "launch at least 4 (e.g. --nproc_per_node=4) or drop them")


def test_torchrun_cli_smoke_writes_one_report_from_rank_0(tmp_path):
    report = tmp_path / "r.md"
    proc = start([*TORCHRUN, "-m", "harness", "run", "--world-sizes", "1,2", "--impl", "fsdp_impl",
                  "--models", "mlp", "--optimizers", "adamw", "--steps", "3", "--report", str(report)])
    try:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stdout + stderr
        assert report.exists() and "fsdp_impl-mlp-ws2-replicated-adamw" in report.read_text()
        # one job, one run: the summary comes from rank 0 only
        assert len(re.findall(r"^\d+ passed, \d+ failed", stderr, flags=re.M)) == 1, stderr
        assert wait_session_empty(proc.pid, 10) == []
    finally:
        kill_session(proc)
