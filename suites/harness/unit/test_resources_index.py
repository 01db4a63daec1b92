"""The memory checks' per-rank index (harness.checks.resources.max_over_ranks): built once per table,
built anew when the table changes, and the same answer as a scan of the table."""

import math

import pandas as pd

from harness.checks.resources import max_over_ranks


def _scan(mem: pd.DataFrame, sid: str, *categories: str) -> float:
    rows = mem[(mem.scenario == sid) & mem.category.isin(categories)]
    return math.nan if set(rows.category) != set(categories) else float(rows.groupby("rank")["bytes"].sum().max())


def test_the_index_answers_as_a_scan_and_follows_a_table_changed_in_place():
    mem = pd.DataFrame(
        {
            "scenario": ["a", "a", "a", "a", "b"],
            "rank": [0, 1, 0, 1, 0],
            "category": ["peak", "peak", "other", "other", "peak"],
            "bytes": [10, 30, 5, 1, 7],
        }
    )
    for sid, cats in (("a", ("peak",)), ("a", ("peak", "other")), ("b", ("peak",)), ("b", ("peak", "other"))):
        got, want = max_over_ranks(mem, sid, *cats), _scan(mem, sid, *cats)
        assert got == want or (math.isnan(got) and math.isnan(want))
    assert max_over_ranks(mem, "a", "peak", "other") == 31
    mem.loc[0, "bytes"] = 100  # rank 0 of a: 100 + 5
    assert max_over_ranks(mem, "a", "peak", "other") == 105
