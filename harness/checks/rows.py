"""Every row trains: a run moves exactly the rows of each parameter that the plain model it is compared
with moves (harness/tables/rows.py reads them from the snapshots). The value checks hold each parameter
to a bound over all its rows; this one names the rows, and the ranks holding them, that one run trained
and the other did not: a vocabulary's uneven tail that no rank's gradient or optimizer reached, or a frozen
or unused row that the run alone updated."""

from __future__ import annotations

import math

from harness.checks.common import ROW, Check, by_scenario, judge, not_measured, not_reference, ok_row, ok_rows
from harness.core.policy import NOISE_FLOOR_FACTOR, Bounds
from harness.core.scenario import REFERENCE_IMPL, Scenario
from harness.core.verdict import Verdict


def rows_trained(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Every dim-0 row of every parameter that the reference moved from its starting value, the run moved
    too, and no other row, by the last step; a row apart fails, named with its parameter, its rows, the
    ranks that hold them and the first step one of them moved."""
    out = []
    apart_of = by_scenario(tables["rows_trained"])
    for row in ok_rows(tables["scenarios"])[lambda d: d.impl != REFERENCE_IMPL].itertuples():
        n, ref = row.rows_compared, Scenario.of_row(row).reference().id
        if n is None or (isinstance(n, float) and math.isnan(n)):
            out.append(not_measured("rows_trained", row, f"no starting and last snapshots of it and of {ref}"))
            continue
        apart = apart_of.get(row.scenario)
        noise = _noise_note(getattr(row, "rows_noise", math.nan), ref)
        if apart is None or not len(apart):
            moved = getattr(row, "rows_moved", math.nan)
            out.append(
                judge(
                    "rows_trained",
                    row,
                    True,
                    0,
                    0,
                    (
                        f"the run moved {'' if noise else 'exactly '}the rows that {ref} moved ({_count(moved)} of the "
                        f"{int(n)} rows of its parameters)" + noise
                    ),
                )
            )
            continue
        apart = apart.sort_values(["step", "param"], kind="stable")
        first = apart.iloc[0]
        rank = _one_rank(first.ranks)
        out.append(
            judge(
                "rows_trained",
                row,
                False,
                len(apart),
                0,
                "; ".join(_phrase(r, ref) for r in apart.head(4).itertuples())
                + (f" (and {len(apart) - 4} more parameters)" if len(apart) > 4 else "")
                + noise,
                step=int(first.step),
                param=str(first.param),
                rank=rank,
                where=f"rows {first.still or first.extra}",
            )
        )
    return out


def params_move(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """A run trains: some parameter moves over the run further than rounding alone moves an element of it
    (NOISE_FLOOR_FACTOR x steps ulps of its largest value: relative to its own size), in every run, the reference
    included. A run that moved nothing (a learning rate so small that no update changes an fp32 value) trained
    nothing, and every other check would pass it by comparing nothing with nothing. A frozen parameter, or a row
    no batch reaches, moving nothing is rows_trained's to judge against the reference; this one asks only that
    the run moved something."""
    out = []
    for row in ok_rows(tables["scenarios"]).itertuples():
        n = getattr(row, "params_moved", math.nan)
        if n is None or (isinstance(n, float) and math.isnan(n)):
            out.append(not_measured("params_move", row, "no starting and last snapshots of it"))
            continue
        steps = f"{int(row.steps)} steps at lr {row.lr:g}"
        if int(n):
            message = f"{int(n)} parameters moved further than rounding alone moves them over {steps}"
            out.append(judge("params_move", row, True, int(n), 0, message))
            continue
        message = (
            f"no parameter moved over {steps} further than rounding alone moves an element ({NOISE_FLOOR_FACTOR:g} x "
            "steps ulps of its largest value): the run trained nothing, and the checks that compare it compare "
            "nothing with nothing (is the learning rate too small for an update to change an fp32 value?)"
        )
        out.append(judge("params_move", row, False, 0, 0, message, step=int(row.steps)))
    return out


def _phrase(r, ref: str) -> str:
    held = f" (held by rank{'s' if ',' in str(r.ranks) else ''} {r.ranks})" if _text(r.ranks) else ""
    parts = []
    if _text(r.still):
        parts.append(f"rows {r.still} of {r.param}{held} never left their starting value, which {ref} moved")
    if _text(r.extra):
        parts.append(f"rows {r.extra} of {r.param}{held if not parts else ''} moved, which {ref} left as they were")
    return " and ".join(parts) + f" (from step {int(r.step)})"


def _noise_note(n, ref: str) -> str:
    """What a verdict says of the rows left unheld at the model's noise level ('' for none)."""
    if n is None or (isinstance(n, float) and math.isnan(n)) or int(n) == 0:
        return ""
    return (
        f"; {int(n)} row{'s' if int(n) > 1 else ''} moved otherwise than in {ref}, but no further than "
        f"{NOISE_FLOOR_FACTOR:g} x the noise floor of their parameter (how far the plain model itself lands when "
        "the batch is cut into the ranks' slices) or than rounding alone moves an element over the run's "
        f"updates ({NOISE_FLOOR_FACTOR:g} x steps ulps of the parameter's largest value), or that a noise probe "
        "moved otherwise than the plain model too, not held: model-sensitive rows, whose gradient is rounding noise"
    )


def _count(x) -> str:
    return "?" if x is None or (isinstance(x, float) and math.isnan(x)) else str(int(x))


def _text(x) -> bool:
    return isinstance(x, str) and x != ""


def _one_rank(ranks) -> int | None:
    return int(ranks) if _text(ranks) and "," not in ranks else None


ROW_CHECKS = (
    Check(params_move, ok_row, {"scenarios": ROW + ("steps", "lr", "params_moved")}),
    Check(
        rows_trained,
        not_reference,
        {
            "scenarios": ROW + ("rows_compared",),
            "rows_trained": ("scenario", "param", "step", "still", "extra", "ranks"),
        },
    ),
)
