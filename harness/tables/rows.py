"""Which rows of each parameter a run moved, against the rows its reference moved (the `rows_trained`
table and `scenarios.rows_compared`), read from the full-parameter snapshots rank 0 writes after every step.

A row is one index of a parameter's dim 0 (an element of a 1-D parameter). It moved when any of its
values differs, bit for bit, from the run's starting snapshot (step 0, or for a resumed run the step it
loaded at); it left its starting value when it moved at any step (SGD's momentum can bring an element back to
its starting value exactly: a DeepSpeed bf16 run's RMSNorm gain went 1.0 -> 0.99999648 -> 0.99999887 -> 1.0).
The sharded run and the plain model it is compared with must move the same rows: a row the
reference trains and the run leaves at its starting value never trained (a tail of rows that no rank's
gradient or optimizer reached); a row the run moves that the reference leaves was trained by the run
alone (a frozen or unused row updated).

Rows at the model's own noise level are held to it. Where a run's batch is cut into slices (split data, and
the nudged clip probes), the plain model doing the same cut (its noise probes, Scenario.noise_probes) is a
correct computation too, and by the last step it lands up to some distance F from the full-batch reference
in each parameter (the parameter's noise floor, as the value checks measure it). A row that moved by no more
than NOISE_FLOOR_FACTOR x F cannot say whether a run trained it: its gradient may be rounding noise (a bias
before a BatchNorm, whose true gradient is zero, moves under SGD by lr x that noise or not at all, and which
rows move depends on the order of summation). So where a parameter has a floor, a row is apart when one run
left it exactly at its starting value and the other moved it beyond the floor (the never-trained row and the
row trained alone); a row one run left and the other moved no further than the floor is counted
(`rows_noise`), not held. Every parameter, with a floor or without one (replicated data has no probes; a
probe may land on the reference exactly), is also allowed what rounding alone can move an element over the
run's updates, a few ulps of the parameter's scale (harness/core/policy.py [Note: rows at rounding level]):
a reduction that rounds otherwise (DDP's, documented) moves such a row by one ulp in one run and not at all
in the other. A row trained for real moves ten thousand ulps and more.
"""

from __future__ import annotations

import math

import torch

from harness.core.policy import NOISE_FLOOR_FACTOR, rounding_drift
from harness.core.scenario import Scenario, ckpt_step


def start_step(sc: Scenario) -> int:
    """The step of a run's first own snapshot: 0, or the step a resumed run loaded at."""
    return ckpt_step(sc.steps) if sc.resume_from else 0


def moved(now: torch.Tensor, start: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """Bool per dim-0 row (one row for a 0-dim parameter): any value differs from `start`, or with a positive
    `limit` is more than `limit` from it (NaN counts as moved)."""
    diff = now != start if limit <= 0 else ~((now.double() - start.double()).abs() <= limit)
    return diff.reshape(1) if diff.dim() == 0 else diff.reshape(diff.shape[0], -1).any(1)


def spans(rows: list[int]) -> str:
    """Row indices as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(str(rows[i]) if i == j else f"{rows[i]}-{rows[j]}")
        i = j + 1
    return ",".join(out)


def holders(rows: list[int], name: str, ranks: list[dict]) -> str:
    """The ranks whose own dim-0 rows of `name` (their record's `rows`) include any of `rows`, comma-separated;
    '' where the ranks recorded no layout (plain tensors, a whole copy on every rank)."""
    out = []
    for rec in ranks:
        span = rec.get("rows", {}).get(name)
        if span is not None and any(span[0] <= r < span[1] for r in rows):
            out.append(str(rec["rank"]))
    return ",".join(out)


def noise_floors(snaps, ref_id: str, probes: list[Scenario], last: int) -> dict[str, float]:
    """parameter -> the largest |difference| at step `last` between the reference `ref_id` and any of its noise
    `probes` that have a snapshot there (parameters where every probe lands on the reference: absent). The same
    difference the params table records as a probe's diff_ref at that step, which checks/noise_floor.py takes the
    largest of over every step for the value checks; rows_trained holds a row's end state only, so its floor is
    the last step's, read here from the snapshots (this table is built beside that one, run by run)."""
    ref, out = snaps.get(ref_id, last), {}
    for probe in probes if ref else ():
        for name, t in (snaps.get(probe.id, last) or {}).items():
            if name in ref and t.shape == ref[name].shape:
                d = float((t.double() - ref[name].double()).abs().max()) if t.numel() else 0.0
                d = math.inf if d != d else d  # a NaN apart: no floor can hold the rows
                if d > 0:
                    out[name] = max(out.get(name, 0.0), d)
    return out


def rows_apart(
    sc: Scenario, snaps, ranks: list[dict], ref_id: str, probes: list[Scenario] = ()
) -> tuple[list[dict], float, float, float]:
    """(rows_trained table rows, rows compared, rows the reference moved, rows apart left unheld) for one run
    against its reference `ref_id`: a table row per parameter whose moved rows differ, with the first step
    where they part. A row is apart only when one run left it exactly and the other moved it beyond the larger
    of the parameter's noise floor (`noise_floors` of `probes`, times NOISE_FLOOR_FACTOR) and its rounding
    drift (`_drift`), and no probe moved it otherwise than the reference (`_probe_rows`: whether such a row
    moves at all is rounding's); the rows apart bit for bit but not held are counted. The counts are NaN where
    a snapshot of either run is missing (the check then fails as not measured)."""
    first, last = start_step(sc), sc.steps
    mine0, ref0 = snaps.get(sc.id, first), snaps.get(ref_id, first)
    mine, ref = snaps.get(sc.id, last), snaps.get(ref_id, last)
    if not (mine0 and ref0 and mine and ref):
        return [], math.nan, math.nan, math.nan
    floor = noise_floors(snaps, ref_id, list(probes), last)
    out, compared, trained, unheld = [], 0, 0, 0
    for name, t in mine.items():
        if (
            name not in ref
            or name not in mine0
            or name not in ref0
            or t.shape != ref[name].shape
            or ref0[name].shape != t.shape
            or mine0[name].shape != t.shape
        ):
            continue  # a parameter full_params lost or misshaped: params_cover_model's
        a, b = moved(t, mine0[name]), moved(ref[name], ref0[name])
        compared, trained = compared + a.numel(), trained + int(b.sum())
        limit = max(
            NOISE_FLOOR_FACTOR * floor.get(name, 0.0), _drift(t, mine0[name], ref[name], ref0[name], steps=last - first)
        )
        a_far, b_far = (moved(t, mine0[name], limit), moved(ref[name], ref0[name], limit)) if limit > 0 else (a, b)
        gone, alone = b_far & ~a, a_far & ~b  # one run left the row exactly as it was, the other moved it far
        if bool((gone | alone).any()):  # ... at every step: a row back at its start by the last step had left it
            mine_ever, ref_ever = (_touched(snaps, run, name, first, last) for run in (sc.id, ref_id))
            if mine_ever is not None and mine_ever.shape == a.shape:
                gone = gone & ~mine_ever
            if ref_ever is not None and ref_ever.shape == b.shape:
                alone = alone & ~ref_ever
        if probes and bool((gone | alone).any()):  # unless a correct split computation is torn over it too
            torn = _probe_rows(snaps, ref_id, probes, name, first, last)
            if torn is not None and torn.shape == a.shape:
                gone, alone = gone & ~torn, alone & ~torn
        unheld += int(((a != b) & ~gone & ~alone).sum())
        still = torch.nonzero(gone).flatten().tolist()  # the reference moved them, this run did not
        extra = torch.nonzero(alone).flatten().tolist()  # this run moved them, the reference did not
        if not (still or extra):
            continue
        step = _first_parting(sc, snaps, ref_id, name, first, still, extra)
        out.append(
            {
                "scenario": sc.id,
                "param": name,
                "step": step,
                "still": spans(still),
                "extra": spans(extra),
                "ranks": holders(still + extra, name, ranks),
            }
        )
    return out, float(compared), float(trained), float(unheld)


def params_moved(sc: Scenario, snaps) -> float:
    """How many parameters the run moved over its own steps further than rounding alone moves an element (`_drift`:
    NOISE_FLOOR_FACTOR x steps ulps of the parameter's largest value, relative to its own size; a NaN counts as
    moved): `params_move` fails a run that moved none, which trained nothing (a learning rate too small for any
    update to change an fp32 value). NaN where its first or last snapshot is missing."""
    first, last = start_step(sc), sc.steps
    start, end = snaps.get(sc.id, first), snaps.get(sc.id, last)
    if not (start and end):
        return math.nan
    count = 0
    for name, t in end.items():
        if name not in start or start[name].shape != t.shape or not t.is_floating_point():
            continue
        limit = _drift(t, start[name], steps=last - first)
        count += bool(moved(t, start[name], limit).any()) if limit > 0 else bool(moved(t, start[name]).any())
    return float(count)


def _probe_rows(snaps, ref_id: str, probes, name: str, first: int, last: int) -> torch.Tensor | None:
    """Bool per row: some noise probe (the plain model on the ranks' slices, a correct split computation) took
    the row off its value at `first` at some step up to `last` where the reference never did, or the other way
    round (None without probes). Such a row's gradient is rounding noise ([Note: rows at rounding level]) and
    whether it moves at all is decided by the last bits of the trajectory: a bias fed to a BatchNorm over small
    slices (whose tiny variance amplifies rounding) may move in a correct run where the plain model leaves it
    exactly, while a probe moves it too (reports/false_alarm_findings.md#seed-4-rows-moved-by-resumed-runs;
    its figures: reports/measured_behaviour.md#rows-at-rounding-level)."""
    ref = _touched(snaps, ref_id, name, first, last)
    torn = None
    for probe in probes if ref is not None else ():
        rows = _touched(snaps, probe.id, name, first, last)
        if rows is not None and rows.shape == ref.shape:
            torn = (rows != ref) if torn is None else torn | (rows != ref)
    return torn


def _touched(snaps, run: str, name: str, first: int, last: int) -> torch.Tensor | None:
    """Bool per row: the row of `name` left its value at `first` at some step up to `last` in `run`."""
    start = snaps.get(run, first)
    if not start or name not in start:
        return None
    out = None
    for k in range(first + 1, last + 1):
        now = snaps.get(run, k)
        if now and name in now and now[name].shape == start[name].shape:
            rows = moved(now[name], start[name])
            out = rows if out is None else out | rows
    return out


def _drift(*tensors: torch.Tensor, steps: int) -> float:
    """How far rounding alone can move an element of this parameter over `steps` updates (policy.rounding_drift):
    its scale is its largest finite |value| in either run at either end."""
    finite = [t[torch.isfinite(t)] for t in tensors if t.is_floating_point()]
    scale = max((float(f.abs().max()) for f in finite if f.numel()), default=0.0)
    return rounding_drift(scale, torch.finfo(tensors[0].dtype).eps, steps) if finite else 0.0


def _first_parting(sc: Scenario, snaps, ref_id: str, name: str, first: int, still: list[int], extra: list[int]) -> int:
    """The first step at which one of the rows apart had moved in the run that moves it."""
    for k in range(first + 1, sc.steps + 1):
        for run, rows in ((ref_id, still), (sc.id, extra)):
            now, start = snaps.get(run, k), snaps.get(run, first)
            if rows and now and name in now and moved(now[name], start[name])[rows].any():
                return k
    return sc.steps
