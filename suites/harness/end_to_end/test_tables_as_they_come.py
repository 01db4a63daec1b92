"""The tables are built while the ranks train (harness.tables.build.TableBuilder): a scenario's rows are made once
its record and those of every run it is compared with are in, on a thread of the parent. Whatever order the records
come in, the tables are those built from all the records at once after the run; a scenario is not made before a run
it reads (its differences would then be NaN, not measured)."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.core.scenario import build_matrix, with_dependencies
from harness.phases import run_matrix
from harness.tables.build import TableBuilder, build_tables, compared_with


@pytest.fixture(scope="module")
def matrix(kept_worlds, tmp_path_factory):
    """A small matrix run with its snapshots kept, its records, and the tables the run built as it went."""
    folder = tmp_path_factory.mktemp("snapshots")
    cells = with_dependencies(build_matrix(["fsdp_impl"], ["mlp"], [1, 2], ["replicated", "split"], ["adamw"], steps=3))
    res = run_matrix(cells, pool=kept_worlds, snapshot_dir=folder)
    return cells, res.records, res.tables


def _same(a: dict[str, pd.DataFrame], b: dict[str, pd.DataFrame]) -> None:
    for name, table in a.items():
        pd.testing.assert_frame_equal(table.reset_index(drop=True), b[name].reset_index(drop=True), check_dtype=False)


def test_the_tables_built_during_the_run_are_those_built_after_it(matrix):
    cells, records, during = matrix
    after = build_tables(cells, records)
    assert after["params"]["diff_ref"].notna().any()  # differences measured, not all NaN alike
    _same(after, {name: during[name] for name in after})


def test_any_order_of_the_records_gives_the_same_tables_on_the_thread(matrix):
    cells, records, _ = matrix
    after = build_tables(cells, records)
    for order in (list(records)[::-1], sorted(records, key=lambda sid: (sid.count("ws2"), sid))):
        builder = TableBuilder(cells, background=True)
        try:
            for sid in order:
                builder.add(sid, records[sid])
            _same(after, builder.finish())
        finally:
            builder.close()


def test_a_scenario_is_made_once_the_runs_it_reads_are_in_and_not_before(matrix):
    cells, records, _ = matrix
    sharded = next(sc for sc in cells if sc.impl == "fsdp_impl" and sc.world_size == 2 and sc.data_mode == "split")
    needs = [sid for sid in compared_with(sharded) if sid in records]
    assert len(needs) >= 3  # the reference, a noise probe, world size 1
    builder = TableBuilder(cells)
    builder.add(sharded.id, records[sharded.id])
    for sid in needs:
        assert sharded.id not in builder.made, f"made before {sid} was in"
        builder.add(sid, records[sid])
    assert sharded.id in builder.made
    # a run it reads that never comes: made at the end, its columns NaN
    alone = TableBuilder(cells)
    alone.add(sharded.id, records[sharded.id])
    tables = alone.finish()
    steps = tables["steps"][tables["steps"].scenario == sharded.id]
    assert len(steps) == sharded.steps and steps["max_diff_ref"].isna().all()
