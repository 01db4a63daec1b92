"""Process worlds: rank order, collectives, reuse, failures, hangs, pools, and no orphan workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness.execute.world import RankFailed, World, WorldError, WorldHung, WorldPool

TASKS = "suites.harness.unit.world_tasks"
ROOT = Path(__file__).resolve().parents[3]


def alive(pid: int) -> bool:
    """Running (a zombie whose new parent does not reap it counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: trust os.kill
        return True


def wait_all_dead(pids: list[int], within_s: float) -> list[int]:
    """The pids still alive after ``within_s`` seconds (empty when all died in time)."""
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout_s=120) as world:
        yield world


def test_results_come_back_in_rank_order_with_the_context(world2):
    omp_before = os.environ.get("OMP_NUM_THREADS")
    payload = {"x": [1, 2, 3], "s": "hello"}
    results = world2.call(f"{TASKS}:whoami", payload)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert (r["world_size"], r["device"], r["backend"]) == (2, "cpu", "gloo")
        assert r["payload"] == {"x": [1, 2, 3], "s": "hello"}
        assert (r["threads"], r["omp_env"], r["deterministic"]) == (1, "1", True)
    assert os.environ.get("OMP_NUM_THREADS") == omp_before  # the parent's env is left alone


def test_a_worker_starts_with_the_preloaded_objects_frozen(world2):
    """The forkserver freezes what its preloading made (harness/execute/preloaded.py): a worker's
    collector, and every census walk (gc.get_objects), starts with torch's import-time objects out of
    its way. Without the freeze they are all walked, in every worker of every new world."""
    for r in world2.call(f"{TASKS}:gc_state", None):
        assert r["frozen"] > r["walked"], r


def test_all_reduce_inside_a_task(world2):
    results = world2.call(f"{TASKS}:all_reduce_sum", 0.5)
    expected = [0.5 + 1.5, 2.0]  # ranks contribute [rank + 0.5, 1]
    assert results == [expected, expected]


def test_a_task_that_replaces_a_torch_function_leaves_the_next_task_torchs(world2):
    """DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear for the whole process: the worker puts it back, so
    the next scenario in that worker (another implementation's, the plain model's) computes with torch's own."""
    assert world2.call(f"{TASKS}:replace_linear", None) == [True, True]
    assert world2.call(f"{TASKS}:linear_is_torchs", None) == [True, True]


def test_a_world_is_reused_across_runs(world2):
    pids = [[r["pid"] for r in world2.call(f"{TASKS}:whoami", i)] for i in range(3)]
    assert pids[0] == pids[1] == pids[2] == world2.pids
    assert os.getpid() not in pids[0] and len(set(pids[0])) == 2


def test_a_raising_rank_gives_rank_failed_and_kills_the_world():
    world = World(2, timeout_s=60)
    with pytest.raises(RankFailed) as info:
        world.call(f"{TASKS}:raise_on_rank", 1)
    message = str(info.value)
    assert "rank 1 " in message and "rank 0 " not in message
    assert "Traceback (most recent call last)" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "world_tasks.py" in message and "raise_on_rank" in message
    assert set(info.value.tracebacks) == {1}
    assert world.broken and wait_all_dead(world.pids, 5) == []
    with pytest.raises(WorldError, match="broken"):
        world.call(f"{TASKS}:whoami", None)


def test_a_rank_that_dies_gives_rank_failed_with_its_exit_code():
    world = World(2, timeout_s=60)
    with pytest.raises(RankFailed, match=r"rank 0 died \(exit code 7\)"):
        world.call(f"{TASKS}:exit_on_rank", 0)
    assert world.broken and wait_all_dead(world.pids, 5) == []


def test_nccl_without_enough_gpus_fails_early_in_one_line():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2 GPUs")
    with pytest.raises(WorldError, match=r"^backend 'nccl' needs 2 CUDA devices, found \d+$"):
        World(2, "nccl")


def test_an_unpicklable_result_is_a_rank_failure():
    with World(1, timeout_s=60) as world, pytest.raises(RankFailed, match="(?i)pickle"):
        world.call(f"{TASKS}:unpicklable", None)


def test_a_bad_function_name_is_refused_before_running(world2):
    with pytest.raises(ValueError, match="package.module:function"):
        world2.call("no_colon_here", None)
    assert not world2.broken


def test_a_hang_names_the_stuck_rank_and_where_it_waits():
    world = World(2, timeout_s=60)
    start = time.monotonic()
    with pytest.raises(WorldHung) as info:
        world.call(f"{TASKS}:hang_on_rank", 1, timeout_s=2.0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 2.0 + 8.0  # the timeout, plus at most the stack dump and the kill
    hung = info.value
    assert (hung.answered, hung.missing) == ([0], [1])
    assert "ranks [1] did not" in str(hung)
    assert "hang_on_rank" in hung.stacks[1] and "all_reduce" in hung.stacks[1]
    assert "world_tasks.py" in str(hung)
    assert world.broken and wait_all_dead(world.pids, 5) == []


def test_pool_reuses_same_world_and_rebuilds_after_a_break():
    with WorldPool(timeout_s=60) as pool:
        first = pool.get(2)
        assert pool.get(2) is first and pool.worlds_started == 1
        second = pool.get(1)  # another size replaces the only live world
        assert second is not first and first.closed and not first.broken
        assert wait_all_dead(first.pids, 5) == [] and pool.worlds_started == 2
        with pytest.raises(RankFailed):
            second.call(f"{TASKS}:raise_on_rank", 0)
        third = pool.get(1)  # same key, but the broken world is rebuilt
        assert third is not second and pool.worlds_started == 3
        assert [r["rank"] for r in third.call(f"{TASKS}:whoami", None)] == [0]
    assert third.closed and wait_all_dead(third.pids, 5) == []


def test_a_keeping_pool_keeps_one_world_per_size_and_closes_them_all():
    with WorldPool(timeout_s=60, keep=True) as pool:
        one, two = pool.get(1), pool.get(2)
        assert pool.get(1) is one and not one.closed and pool.get(2) is two and pool.worlds_started == 2
        with pytest.raises(RankFailed):
            two.call(f"{TASKS}:raise_on_rank", 1)
        again = pool.get(2)  # the broken one is rebuilt, the other size is left alone
        assert again is not two and pool.get(1) is one and pool.worlds_started == 3
        assert [r["rank"] for r in again.call(f"{TASKS}:whoami", None)] == [0, 1]
    assert one.closed and again.closed and wait_all_dead(one.pids + again.pids, 5) == []


def test_two_worlds_run_collectives_at_the_same_time_without_colliding():
    with World(2, timeout_s=60) as a, World(2, timeout_s=60) as b:
        results: dict[str, list] = {}
        threads = [
            threading.Thread(
                target=lambda n=n, w=w, off=off: results.__setitem__(n, w.call(f"{TASKS}:all_reduce_sum", off))
            )
            for n, w, off in (("a", a, 10.0), ("b", b, 100.0))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["a"] == [[21.0, 2.0]] * 2  # (0 + 10) + (1 + 10)
        assert results["b"] == [[201.0, 2.0]] * 2  # (0 + 100) + (1 + 100)
        assert set(a.pids).isdisjoint(b.pids)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process for the test, even where pytest was started
    with it ignored (a script's background job, where Python installs no handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_the_parent_kills_the_world(sigint_raises):
    world = World(2, timeout_s=60)
    main = threading.main_thread().ident
    timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))  # Ctrl-C, mid-run
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            world.call(f"{TASKS}:hang_on_rank", 1)  # rank 1 blocks in all_reduce; rank 0 idles
    finally:
        timer.cancel()
    assert world.broken and wait_all_dead(world.pids, 5) == []


ORPHAN_SCRIPT = textwrap.dedent(f"""
    from harness.execute.world import World
    if __name__ == "__main__":
        world = World(2, timeout_s=600)
        print(*world.pids, flush=True)
        world.call("{TASKS}:sleep", 600)  # no rank can be woken by a peer's death
""")


@pytest.mark.ci  # a parent process started and killed
def test_no_worker_outlives_a_killed_parent(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, parent.stderr.read()
        time.sleep(0.5)  # let the ranks start sleeping
        assert all(alive(p) for p in pids)
        parent.kill()  # SIGKILL: no atexit, no finally; only the workers' lifeline can act
        parent.wait(30)
        assert wait_all_dead(pids, 10) == []
    finally:
        parent.kill()
        parent.wait()


def test_a_world_that_times_out_while_starting_is_reported_hung_not_a_traceback():
    """What a tiny timeout used to hit: a rank that had not made its stack file yet. Whether it had by the
    time the parent looks depends on how fast a worker starts (a forkserver whose preload is frozen forks
    faster): either way the world is reported hung, with each silent rank's state, never a traceback."""
    with pytest.raises(WorldHung, match=r"hung in start: ranks \[\] answered, ranks \[0\] did not") as hung:
        World(1, timeout_s=1e-6)
    assert "--- rank 0 (pid" in str(hung.value)
    stack = hung.value.stacks[0]
    assert (
        stack == "(no stack: the rank had not started yet)"
        or "Current thread" in stack
        or stack == "(no stack: no answer to SIGUSR1)"
    ), stack
