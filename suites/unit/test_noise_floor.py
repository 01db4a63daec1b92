"""Split data held parameter by parameter, with the model's own noise floor (harness/core/policy.py
[Note: noise floor]): a floor lifts only its own parameter, and only to NOISE_FLOOR_FACTOR x the floor."""

import pandas as pd

from harness.checks import norms
from harness.checks import numeric as checks
from harness.checks.noise_floor import sensitivity_table
from harness.core.policy import NOISE_FLOOR_FACTOR, Bounds
from harness.core.scenario import Scenario
from harness.report.noise import _noise_section
from suites.unit.synthetic_tables import frame

RUN = Scenario("fsdp_impl", "mha_lm", 4, "split", "adamw", steps=3)
TIER = Bounds().split_bound("adamw", RUN.lr, 3)
NOISY, HEALTHY = "blocks.0.attn.in_proj_bias", "blocks.0.fc.weight"


def tables(run_diffs: dict, probe_floor: dict, *, batch_stats: str = "", probes=None, run=RUN,
           probe_diffs: dict | None = None, from_step: int = 2):
    """The run, its reference and its probes over 3 steps; `run_diffs` / `probe_floor`: param -> diff_ref
    reached at `from_step` (0 before); `probe_diffs`: param -> the run's diff_probe from then on."""
    probes = run.noise_probes() if probes is None else probes
    cells = [(run.reference(), {}, {}), *[(p, probe_floor, {}) for p in probes], (run, run_diffs, probe_diffs or {})]
    scen, steps, params = [], [], []
    for sc, diffs, dprobe in cells:
        head = dict(scenario=sc.id, impl=sc.impl, model=sc.model, world_size=sc.world_size, data_mode=sc.data_mode,
                    optimizer=sc.optimizer, seed=sc.seed, feature=sc.feature, resume_from=sc.resume_from,
                    micro_batches=sc.micro_batches, reverse_micro=sc.reverse_micro)
        scen.append(dict(head, steps=3, lr=sc.lr, status="ok", error="", batch_stats=batch_stats))
        for k in (1, 2, 3):
            at = {p: (d if k >= from_step else 0.0) for p, d in diffs.items()}
            atp = {p: (d if k >= from_step else 0.0) for p, d in dprobe.items()}
            for p in (NOISY, HEALTHY):
                params.append(dict(scenario=sc.id, step=k, param=p, numel=4, diff_ref=at.get(p, 0.0),
                                   diff_ws1=0.0, sum=1.0, diff_probe=atp.get(p, 0.0)))
            worst = max((NOISY, HEALTHY), key=lambda p: at.get(p, 0.0))
            steps.append(dict(head, step=k, loss=1.0 / k, grad_norm=1.0, max_diff_ref=at.get(worst, 0.0),
                              worst_param_ref=worst, max_diff_ws1=0.0, worst_param_ws1=worst,
                              max_diff_probe=max(atp.values(), default=0.0), worst_param_probe=worst))
    return {"scenarios": frame("scenarios", scen), "steps": frame("steps", steps), "params": frame("params", params)}


def verdict(t):
    return next(v for v in checks.split_matches_full_batch(t) if v.scenario == RUN.id)


def test_a_parameter_at_its_noise_floor_is_held_to_it_and_named():
    floor = 0.6 * TIER * 20  # the plain model's own cut moves it 12x the tier bound
    v = verdict(tables({NOISY: 1.9 * floor}, {NOISY: floor}))
    assert v.status == "pass" and v.bound == TIER
    assert "1 of 2 parameters model-sensitive" in v.message and NOISY in v.message
    # beyond the factor it fails, named, at the step it crossed
    v = verdict(tables({NOISY: (NOISE_FLOOR_FACTOR + 0.1) * floor}, {NOISY: floor}))
    assert v.status == "fail" and (v.step, v.param) == (2, NOISY)


def test_without_a_floor_the_same_difference_fails_as_before():
    v = verdict(tables({NOISY: 12 * TIER}, {}))
    assert v.status == "fail" and (v.step, v.param) == (2, NOISY) and "model-sensitive" not in v.message


def test_a_floor_loosens_nothing_for_a_healthy_parameter():
    """A healthy parameter just over the tier's bound fails though its neighbour has a large floor; a
    floor below TIER / NOISE_FLOOR_FACTOR changes no bound."""
    v = verdict(tables({NOISY: TIER * 5, HEALTHY: TIER * 1.01}, {NOISY: TIER * 5}))
    assert v.status == "fail" and v.param == HEALTHY and v.measured == TIER * 1.01
    v = verdict(tables({HEALTHY: TIER * 1.01}, {HEALTHY: TIER / NOISE_FLOOR_FACTOR * 0.99}))
    assert v.status == "fail" and v.param == HEALTHY


def test_a_probe_that_did_not_run_fails_the_check_by_name():
    t = tables({}, {})
    lost = RUN.noise_probes()[1].id
    t["scenarios"] = t["scenarios"][t["scenarios"].scenario != lost]
    v = verdict(t)
    assert v.status == "fail" and lost in v.message and "could not be checked" in v.message


def test_batch_statistics_are_held_to_the_rank_order_probe_with_the_order_floor():
    layers = "hidden.0.1"
    # far from the full batch (per-rank statistics) yet equal to the probe: passes, and says why
    v = verdict(tables({NOISY: 1.0, HEALTHY: 1.0}, {NOISY: 1.0, HEALTHY: 1.0}, batch_stats=layers))
    assert v.status == "pass" and "batch statistics" in v.message and layers in v.message
    # at W = 2 (one order of summation only) every step is held: off the probe by more than the tier's bound
    # at step 2 fails
    two = RUN.at_world_size(2)
    v = next(v for v in checks.split_matches_full_batch(
        tables({}, {}, batch_stats=layers, run=two, probe_diffs={HEALTHY: 2 * TIER})) if v.scenario == two.id)
    assert v.status == "fail" and (v.step, v.param) == (2, HEALTHY)
    # beyond 2 ranks only the first step is held (the orders of summation part step by step), and it says so
    v = verdict(tables({}, {}, batch_stats=layers, probe_diffs={HEALTHY: 2 * TIER}))
    assert v.status == "pass" and "held at step 1 only" in v.message
    v = verdict(tables({}, {}, batch_stats=layers, probe_diffs={HEALTHY: 2 * TIER}, from_step=1))
    assert v.status == "fail" and (v.step, v.param) == (1, HEALTHY)
    # step-1 gradient norm and convergence are held to the probe too
    t = tables({}, {}, batch_stats=layers)
    assert {v.status for v in norms.grad_norm_matches(t) if v.scenario == RUN.id} == {"pass"}
    resumed = RUN.replace(feature="ckpt", resume_from=2)
    v = next(v for v in checks.split_matches_full_batch(tables({}, {}, batch_stats=layers, run=resumed))
             if v.scenario == resumed.id)
    assert v.status == "skip" and "does not apply" in v.message


def test_the_report_counts_the_model_sensitive_parameters_per_model():
    floor = 10 * TIER
    t = tables({NOISY: floor}, {NOISY: floor})
    table = sensitivity_table(t)
    assert set(table.sensitive) == {1} and set(table.params) == {2}
    assert all(NOISY in w for w in table.which)
    text = "\n".join(_noise_section(t))
    assert "model-sensitive, held to its noise floor" in text and NOISY in text
    quiet = "\n".join(_noise_section(tables({}, {})))
    assert "No parameter of any model is model-sensitive" in quiet
    assert _noise_section({"scenarios": pd.DataFrame(), "params": pd.DataFrame()}) == []
