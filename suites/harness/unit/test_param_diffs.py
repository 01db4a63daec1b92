"""The params and rank_diffs tables' differences (harness.tables.build), taken over the flat values of every
parameter at once, against their definition written out a parameter and a rank's rows at a time."""

from __future__ import annotations

import math

import torch

from harness.tables.build import param_diffs, rank_row_diffs


def _one_at_a_time(cur: dict, other: dict) -> dict[str, float]:
    out = {}
    for name, t in cur.items():
        o = other.get(name)
        if o is None or o.shape != t.shape:
            out[name] = math.inf
        elif not torch.isfinite(t).all():
            out[name] = math.nan
        else:
            d = (t.double() - o.double()).abs()
            out[name] = float(d.max()) if d.numel() else 0.0
    return out


def _same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def _pair():
    g = torch.Generator().manual_seed(0)
    cur = {
        "a": torch.randn(5, 3, generator=g),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
        "b": torch.randn(8, generator=g),
        "nan_here": torch.tensor([1.0, float("nan"), 2.0]),
        "inf_here": torch.tensor([[1.0, float("inf")], [0.0, 0.0]]),
        "nan_there": torch.ones(4),
        "reshaped": torch.ones(6),
        "missing": torch.ones(2),
        "zero_cols": torch.zeros(3, 0),
        "inf_against_finite": torch.tensor([float("inf"), 1.0]),
    }
    other = {k: v.clone() for k, v in cur.items() if k != "missing"}
    other["a"] = cur["a"] + 1e-7 * torch.randn(5, 3, generator=g)
    other["b"][3] += 2.0**-20
    other["scalar"] = torch.tensor(1.25)
    other["nan_there"][2] = float("nan")
    other["reshaped"] = torch.ones(2, 3)
    other["inf_against_finite"] = torch.tensor([0.0, 1.0])  # an inf difference, but cur is not finite: NaN
    return cur, other


def test_every_parameter_at_once_gives_what_one_at_a_time_gives():
    cur, other = _pair()
    got, want = param_diffs(cur, other), _one_at_a_time(cur, other)
    assert list(got) == list(cur)
    assert all(_same(got[n], want[n]) for n in cur), (got, want)
    assert got["b"] == 2.0**-20 and got["a"] > 0 and math.isnan(got["nan_there"]) and got["missing"] == math.inf
    assert math.isnan(got["inf_against_finite"])
    assert param_diffs(cur, None) == {} and param_diffs({}, other) == {}


def test_each_rank_s_rows_are_compared_on_their_own():
    cur, other = _pair()
    ranks = [
        {"rank": r, "rows": {"a": (2 * r, 2 * r + 2), "b": (4 * r, 4 * r + 4), "zero_cols": (r, r + 1)}}
        for r in range(3)
    ]
    d = param_diffs(cur, other)
    rows = rank_row_diffs("s", 1, ranks, cur, other, None, d, {})
    for row in rows:
        a, b = ranks[row["rank"]]["rows"][row["param"]]
        want = (cur[row["param"]][a:b].double() - other[row["param"]][a:b].double()).abs()
        assert row["diff_ref"] == (float(want.max()) if want.numel() else 0.0), row
        assert math.isnan(row["diff_ws1"])
    named = {(r["param"], r["rank"]) for r in rows}
    assert ("b", 0) in named and ("a", 2) in named  # rank 2 holds row 4 of a: one row, the last
    assert [r["diff_ref"] for r in rows if r["param"] == "b"] == [2.0**-20, 0.0, 0.0]
