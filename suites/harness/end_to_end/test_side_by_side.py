"""Where a world's ranks fit the cores, scenarios of one world size run side by side, each in a world of its own
(harness.execute.executor, ReusedWorlds.lanes): they must give what one at a time gives, bit for bit, and a scenario
that fails in one world must leave the others to finish."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.core.children import usable_cpus
from harness.core.scenario import Scenario, build_matrix, with_dependencies
from harness.execute.executor import ReusedWorlds, execute
from harness.execute.world import WorldPool
from harness.tables.build import build_tables

TIMING = ["step_time_s", "jitter_s"]


class OneAtATime(ReusedWorlds):
    def lanes(self, sc: Scenario) -> int:
        return 1


@pytest.fixture(scope="module")
def pool():
    if usable_cpus() < 2:
        pytest.skip("one core: scenarios run one at a time, there is nothing side by side to hold")
    with WorldPool() as worlds:
        yield worlds


@pytest.mark.parametrize("size", [1, 2])
def test_side_by_side_gives_what_one_at_a_time_gives(pool, tmp_path, size):
    """Worlds of 1 (the cores outnumber their ranks), and of 2 (two worlds on the cores one fits: its ranks wait on
    each other's collectives)."""
    # a world twice the size in the run: worlds side by side never hold more ranks than its largest (harness.limits)
    cells = with_dependencies(
        build_matrix(["fsdp_impl"], ["mlp"], [size], ["replicated", "split"], ["sgd", "adamw"], steps=2)
    ) + [Scenario("fsdp_impl", "mlp", 2 * size, "replicated", "sgd", steps=2)]
    side = ReusedWorlds(pool, 300.0)
    assert side.lanes(Scenario("fsdp_impl", "mlp", size, "replicated", "sgd")) >= 2
    started = pool.worlds_started
    together = execute(cells, snapshot_dir=tmp_path / "side", pool=side)
    assert pool.worlds_started - started >= 3  # a world of `size` a lane, the world twice its size
    spans = sorted((r["ended"] - r["seconds"], r["ended"]) for sid, r in together.items() if f"-ws{size}-" in sid)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), "no two scenarios overlapped"
    alone = execute(cells, snapshot_dir=tmp_path / "alone", pool=OneAtATime(pool, 300.0))
    a, b = build_tables(cells, together), build_tables(cells, alone)
    for name in ("steps", "params", "memory", "scenarios"):
        left, right = a[name].drop(columns=TIMING, errors="ignore"), b[name].drop(columns=TIMING, errors="ignore")
        pd.testing.assert_frame_equal(left, right, check_exact=True)
    assert (a["scenarios"].status == "ok").all()


def test_a_scenario_that_fails_in_one_world_leaves_the_others_to_finish(pool, tmp_path):
    broken = Scenario("fsdp_impl", "suites.harness.unit.example_model:no_such_factory", 1, "replicated", "sgd", steps=2)
    fine = [
        Scenario("fsdp_impl", "mlp", 1, mode, opt, steps=2)
        for mode in ("replicated", "split")
        for opt in ("sgd", "adamw")
    ]
    two = Scenario("fsdp_impl", "mlp", 2, "replicated", "sgd", steps=2)  # the run's largest world: 2 ranks
    records = execute([fine[0], broken, *fine[1:], two], snapshot_dir=tmp_path, pool=ReusedWorlds(pool, 300.0))
    assert "no_such_factory" in records[broken.id]["error"]
    ran = [*fine, two]
    assert all("ranks" in records[sc.id] for sc in ran), {sc.id: records[sc.id].get("error") for sc in ran}


def test_worlds_side_by_side_never_hold_more_ranks_than_the_runs_largest_world(pool, tmp_path):
    """harness.limits checks that the largest world size fits this machine's memory: a run of worlds of 1 alone runs
    them one at a time, however many cores there are."""
    cells = [
        Scenario("fsdp_impl", "mlp", 1, mode, opt, steps=2)
        for mode in ("replicated", "split")
        for opt in ("sgd", "adamw")
    ]
    started = pool.worlds_started
    records = execute(cells, snapshot_dir=tmp_path, pool=ReusedWorlds(pool, 300.0))
    spans = sorted((r["ended"] - r["seconds"], r["ended"]) for r in records.values())
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), "two scenarios overlapped"
    assert pool.worlds_started - started <= 1
