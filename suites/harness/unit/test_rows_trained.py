"""Every row trains (`rows_trained`): the rows a run moved, read from its snapshots, against its reference's.
The snapshots here are hand-made tensors; which rows moved is written down from how they were made."""

from __future__ import annotations

import math

import torch

from harness.checks.registry import run_checks
from harness.core.scenario import Scenario
from harness.core.verdict import FAIL, PASS
from harness.tables.rows import moved, rows_apart, spans
from suites.harness.unit import synthetic_tables as syn

SC = Scenario("fsdp_impl", "tied_vocab33", 8, "replicated", "adamw", steps=3)
REF = SC.reference().id
RANKS = [{"rank": r, "rows": {"embed.weight": [min(5 * r, 33), min(5 * r + 5, 33)]}} for r in range(8)]


class Snaps:
    """scenario id -> {step: {name: tensor}}, read as harness.tables.build._Snapshots is."""

    def __init__(self, runs: dict):
        self.runs = runs

    def get(self, sid, step):
        return self.runs.get(sid, {}).get(step)


def trajectory(rows_moving: range, steps: int = 3, bias_moves: bool = True) -> dict:
    """An embedding of 33 x 4 and a bias of 4: the given rows (and the bias) change at every step."""
    out, w, b = {}, torch.zeros(33, 4), torch.zeros(4)
    for k in range(steps + 1):
        out[k] = {"embed.weight": w.clone(), "norm.bias": b.clone()}
        w[list(rows_moving), 1] += 0.5
        if bias_moves:
            b += 0.25
    return out


def test_a_row_moved_when_any_of_its_values_changed():
    start = torch.zeros(4, 3)
    now = start.clone()
    now[2, 1] = 1e-30
    assert moved(now, start).tolist() == [False, False, True, False]
    assert moved(torch.tensor([0.0, 1.0]), torch.zeros(2)).tolist() == [False, True]  # 1-D: an element a row
    assert moved(torch.tensor(2.0), torch.tensor(2.0)).tolist() == [False]
    assert spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and spans([]) == ""


def test_rows_the_reference_trains_and_the_run_leaves_are_named_with_their_rank():
    snaps = Snaps({REF: trajectory(range(33)), SC.id: trajectory(range(30))})  # rows 30-32 never move
    apart, compared, trained, unheld = rows_apart(SC, snaps, RANKS, REF)
    assert (compared, trained, unheld) == (33 + 4, 33 + 4, 0)
    assert apart == [
        {"scenario": SC.id, "param": "embed.weight", "step": 1, "still": "30-32", "extra": "", "ranks": "6"}
    ]


def test_a_row_that_moved_and_came_back_to_its_start_by_the_last_step_left_it():
    """A row the run moved at step 1 and brought back exactly by the last (SGD's momentum did it to a DeepSpeed bf16
    run's RMSNorm gain) trained; rows 30-32, never moved at any step, are still the run's rows apart."""
    ref = trajectory(range(33))
    run = trajectory(range(30))
    run[1]["embed.weight"][31, 0] = 0.5  # row 31 moves at step 1 and is back at 0.0 from step 2
    apart, _, _, _ = rows_apart(SC, Snaps({REF: ref, SC.id: run}), RANKS, REF)
    assert [(a["param"], a["still"]) for a in apart] == [("embed.weight", "30,32")]
    ref[2]["norm.bias"] = ref[3]["norm.bias"] = ref[0]["norm.bias"].clone()  # the same, the other way round
    run = trajectory(range(33))
    apart, _, _, _ = rows_apart(SC, Snaps({REF: ref, SC.id: run}), RANKS, REF)
    assert apart == []


def test_rows_the_run_alone_moves_are_named_from_the_step_they_move():
    ref = trajectory(range(33), bias_moves=False)
    run = trajectory(range(33), bias_moves=False)
    run[2]["norm.bias"][3] = 1.0
    run[3]["norm.bias"][3] = 1.0
    apart, _, trained, _ = rows_apart(SC, Snaps({REF: ref, SC.id: run}), RANKS, REF)
    assert trained == 33
    assert apart == [{"scenario": SC.id, "param": "norm.bias", "step": 2, "still": "", "extra": "3", "ranks": ""}]


def test_a_missing_snapshot_is_not_measured():
    apart, compared, trained, unheld = rows_apart(SC, Snaps({REF: trajectory(range(33))}), RANKS, REF)
    assert apart == [] and math.isnan(compared) and math.isnan(trained) and math.isnan(unheld)


SPLIT = Scenario("fsdp_impl", "bn_mlp", 8, "split", "sgd", steps=3)  # a probe of the ranks' slices exists


def _bias_moving(rows: dict[int, float]) -> dict:
    """A bias of 6 whose given rows move by the given amount at each of the 3 steps."""
    out, b = {}, torch.zeros(6)
    for k in range(4):
        out[k] = {"hidden.0.0.bias": b.clone()}
        for r, by in rows.items():
            b[r] += by
    return out


NOISE, MID, REAL = 1e-12, 1e-8, 1e-3  # a step of lr x a rounding-noise gradient; a small step; a trained row's step


def test_rows_that_moved_no_further_than_the_models_noise_floor_are_counted_not_held():
    """A bias before a BatchNorm: its true gradient is zero, so under SGD a row moves by lr x rounding noise
    or not at all, and which rows move depends on how the batch is cut and summed. The plain model cut into
    the ranks' slices (the noise probe) lands 3e-12 from the full batch there: a row the run moved by no more
    than 2 x that is not held; a row moved, or left, by a trained row's step still is."""
    ref_id, probes = SPLIT.reference().id, SPLIT.noise_probes()
    assert probes, "a split run at 8 ranks has noise probes"
    runs = {ref_id: _bias_moving({0: REAL, 1: NOISE}), probes[0].id: _bias_moving({0: REAL, 2: NOISE, 3: NOISE})}
    runs[SPLIT.id] = _bias_moving({0: REAL, 4: NOISE})  # rows 1 (ref only) and 4 (run only): noise
    apart, compared, trained, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert (apart, compared, trained, unheld) == ([], 6, 2, 2)
    runs[SPLIT.id] = _bias_moving({1: NOISE, 4: NOISE, 5: REAL})  # row 0 never trained, row 5 trained alone
    apart, _, _, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert unheld == 1 and [(a["param"], a["still"], a["extra"]) for a in apart] == [("hidden.0.0.bias", "0", "5")]
    # rows moved by 1e-8 a step: beyond what rounding moves a parameter of this scale (3e-3: a few ulps are
    # 1e-9), within 2 x the floor of a probe that moved others as far
    runs = {
        ref_id: _bias_moving({0: REAL, 1: MID}),
        probes[0].id: _bias_moving({0: REAL, 2: MID, 3: MID}),
        SPLIT.id: _bias_moving({0: REAL, 4: MID}),
    }
    apart, _, _, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert (apart, unheld) == ([], 2)
    apart, _, _, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id)  # without its probes: no floor
    assert unheld == 0 and (apart[0]["still"], apart[0]["extra"]) == ("1", "4")


def test_a_row_a_noise_probe_moves_where_the_plain_model_does_not_is_rounding_however_far_the_run_moves_it():
    """Seed 4 of the standard architectures: bn_mlp's first bias feeds a BatchNorm over two-sample slices at 8
    ranks, whose tiny variance amplifies rounding. Its row 16 stayed exactly in the plain model, its 8-slice
    probe moved it 1.1e-8 (so the floor of 2 x the probes' farthest is small), and runs resumed at 8 ranks from
    2, a trajectory no probe follows, moved it 8.7e-7. A correct split computation already disagrees with the
    plain model about whether that row moves: it is not held. A row that no probe moves otherwise (a frozen
    row, a row every run trains) still is, however little the run moved it."""
    ref_id, probes = SPLIT.reference().id, SPLIT.noise_probes()
    runs = {
        ref_id: _bias_moving({0: REAL}),
        probes[0].id: _bias_moving({0: REAL, 1: NOISE}),
        SPLIT.id: _bias_moving({0: REAL, 1: 100 * MID}),
    }  # far beyond 2 x the floor and any rounding drift
    apart, compared, trained, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert (apart, compared, trained, unheld) == ([], 6, 1, 1)
    runs[SPLIT.id] = _bias_moving({0: REAL, 1: 100 * MID, 2: 100 * MID})  # row 2: no probe moves it
    apart, _, _, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert unheld == 1 and [(a["still"], a["extra"]) for a in apart] == [("", "2")]
    # seed 4 at 8 ranks resumed from 4: the probe moved the row at one step and back at the next
    there_and_back = _bias_moving({0: REAL})
    there_and_back[2]["hidden.0.0.bias"][1] += NOISE
    runs[probes[0].id] = there_and_back
    apart, _, _, unheld = rows_apart(SPLIT, Snaps(runs), [], ref_id, probes)
    assert unheld == 1 and [(a["still"], a["extra"]) for a in apart] == [("", "2")]


REPLICATED = Scenario("ddp", "bn_mlp", 8, "replicated", "sgd", steps=10)  # no noise probe


def test_a_row_one_run_moved_by_an_ulp_and_the_other_left_is_rounding_not_a_row_apart():
    """Seed 1 of the standard architectures: bn_mlp's first bias (values up to 0.28, true gradient zero) had
    row 25 stay exactly in the plain model and move by one ulp of its value at step 2 in DDP at 8 ranks, whose
    reduction rounds otherwise. Rounding moves an element by about an ulp of its parameter's scale per update
    (policy [Note: rows at rounding level]); a row trained for real moves thousands of ulps."""
    ref_id = REPLICATED.reference().id
    start = torch.linspace(-0.28, 0.28, 29)
    ref = {k: {"hidden.0.0.bias": start.clone()} for k in range(11)}
    run = {k: {"hidden.0.0.bias": start.clone()} for k in range(11)}
    one_ulp = torch.nextafter(start[25], torch.tensor(1.0))
    for k in range(2, 11):
        run[k]["hidden.0.0.bias"][25] = one_ulp
    apart, compared, trained, unheld = rows_apart(REPLICATED, Snaps({ref_id: ref, REPLICATED.id: run}), [], ref_id)
    assert (apart, compared, trained, unheld) == ([], 29, 0, 1)
    for k in range(2, 11):  # a step of lr x a small real gradient: 0.05 x 1e-4
        run[k]["hidden.0.0.bias"][25] = start[25] + 5e-6
    apart, _, _, unheld = rows_apart(REPLICATED, Snaps({ref_id: ref, REPLICATED.id: run}), [], ref_id)
    assert unheld == 0 and [(a["extra"], a["step"]) for a in apart] == [("25", 2)]


def test_the_verdict_says_how_many_rows_it_left_unheld_and_why():
    t = _tables([])
    t["scenarios"] = t["scenarios"].assign(rows_noise=3.0)
    verdicts = [v for v in run_checks(t) if v.check == "rows_trained"]
    assert verdicts and all(
        v.status == PASS
        and "; 3 rows moved otherwise than in" in v.message
        and "model-sensitive rows" in v.message
        and "noise floor" in v.message
        for v in verdicts
    )


def _tables(apart: list[dict], compared=syn.ROWS):
    t = {k: v for k, v in syn.make_tables(fail=False).items() if k != "verdicts"}
    t["rows_trained"] = syn.frame("rows_trained", apart)
    t["scenarios"] = t["scenarios"].assign(rows_compared=compared)
    return t


def test_the_check_fails_a_run_whose_rows_stayed_naming_parameter_rows_rank_and_step():
    bad = syn.sid(2, "split")
    apart = [{"scenario": bad, "param": "layers.1.weight", "step": 1, "still": "9", "extra": "", "ranks": "1"}]
    verdicts = [v for v in run_checks(_tables(apart)) if v.check == "rows_trained"]
    failed = [v for v in verdicts if v.status == FAIL]
    assert [v.scenario for v in failed] == [bad]
    v = failed[0]
    assert (v.step, v.param, v.rank) == (1, "layers.1.weight", 1)
    assert "rows 9 of layers.1.weight (held by rank 1) never left their starting value" in v.message
    others = [v for v in verdicts if v.scenario != bad]
    assert others and all(v.status == PASS and f"{syn.ROWS} of the {syn.ROWS} rows" in v.message for v in others)


def test_the_check_fails_as_not_measured_without_the_counts():
    verdicts = [v for v in run_checks(_tables([], compared=math.nan)) if v.check == "rows_trained"]
    assert verdicts and all(v.status == FAIL and "could not be checked" in v.message for v in verdicts)
