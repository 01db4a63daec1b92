"""Split data held parameter by parameter, with the model's own noise floor (harness/core/policy.py
[Note: noise floor]): a floor lifts only its own parameter, and only to NOISE_FLOOR_FACTOR x the floor."""

import pandas as pd

from harness.checks import norms
from harness.checks import numeric as checks
from harness.checks.noise_floor import sensitivity_table
from harness.core.policy import ADAMW_BETAS, NOISE_FLOOR_FACTOR, Bounds, adamw_reach
from harness.core.scenario import Scenario
from harness.report.noise import noise_section
from suites.harness.unit.synthetic_tables import frame

RUN = Scenario("fsdp_impl", "mha_lm", 4, "split", "adamw", steps=3)
TIER = Bounds().split_bound("adamw", RUN.lr, 3)
NOISY, HEALTHY = "blocks.0.attn.in_proj_bias", "blocks.0.fc.weight"


def tables(
    run_diffs: dict,
    probe_floor: dict,
    *,
    batch_stats: str = "",
    probes=None,
    run=RUN,
    probe_diffs: dict | None = None,
    from_step: int = 2,
):
    """The run, its reference and its probes over 3 steps; `run_diffs` / `probe_floor`: param -> diff_ref
    reached at `from_step` (0 before); `probe_diffs`: param -> the run's diff_probe from then on."""
    probes = run.noise_probes() if probes is None else probes
    cells = [(run.reference(), {}, {}), *[(p, probe_floor, {}) for p in probes], (run, run_diffs, probe_diffs or {})]
    scen, steps, params = [], [], []
    for sc, diffs, dprobe in cells:
        head = dict(
            scenario=sc.id,
            impl=sc.impl,
            model=sc.model,
            world_size=sc.world_size,
            data_mode=sc.data_mode,
            optimizer=sc.optimizer,
            seed=sc.seed,
            feature=sc.feature,
            resume_from=sc.resume_from,
            micro_batches=sc.micro_batches,
            reverse_micro=sc.reverse_micro,
            nudge=sc.nudge,
        )
        scen.append(dict(head, steps=3, lr=sc.lr, status="ok", error="", batch_stats=batch_stats))
        for k in (1, 2, 3):
            at = {p: (d if k >= from_step else 0.0) for p, d in diffs.items()}
            atp = {p: (d if k >= from_step else 0.0) for p, d in dprobe.items()}
            for p in (NOISY, HEALTHY):
                params.append(
                    dict(
                        scenario=sc.id,
                        step=k,
                        param=p,
                        numel=4,
                        diff_ref=at.get(p, 0.0),
                        diff_ws1=0.0,
                        sum=1.0,
                        diff_probe=atp.get(p, 0.0),
                    )
                )
            worst = max((NOISY, HEALTHY), key=lambda p: at.get(p, 0.0))
            steps.append(
                dict(
                    head,
                    step=k,
                    loss=1.0 / k,
                    grad_norm=1.0,
                    max_diff_ref=at.get(worst, 0.0),
                    worst_param_ref=worst,
                    max_diff_ws1=0.0,
                    worst_param_ws1=worst,
                    max_diff_probe=max(atp.values(), default=0.0),
                    worst_param_probe=worst,
                )
            )
    return {"scenarios": frame("scenarios", scen), "steps": frame("steps", steps), "params": frame("params", params)}


def verdict(t):
    return next(v for v in checks.split_matches_full_batch(t) if v.scenario == RUN.id)


def test_a_parameter_at_its_noise_floor_is_held_to_it_and_named():
    floor = 0.6 * TIER * 20  # the plain model's own cut moves it 12x the tier bound
    v = verdict(tables({NOISY: 1.9 * floor}, {NOISY: floor}))
    assert v.status == "pass" and v.bound == TIER
    assert "1 of 2 parameters model-sensitive" in v.message and NOISY in v.message
    # under AdamW a rounding-led parameter is held to the optimizer's reach beyond 2 x its floor, and no further
    reach = adamw_reach(RUN.lr, 3)
    assert reach > (NOISE_FLOOR_FACTOR + 0.1) * floor
    v = verdict(tables({NOISY: (NOISE_FLOOR_FACTOR + 0.1) * floor}, {NOISY: floor}))
    assert v.status == "pass" and "AdamW's reach" in v.message
    v = verdict(tables({NOISY: 1.01 * reach}, {NOISY: floor}))
    assert v.status == "fail" and (v.step, v.param) == (2, NOISY)
    # SGD has no reach: beyond the factor it fails, named, at the step it crossed
    sgd = RUN.replace(optimizer="sgd")
    sgd_floor = Bounds().split_bound("sgd", sgd.lr, 3) * 20
    v = next(
        v
        for v in checks.split_matches_full_batch(
            tables({NOISY: (NOISE_FLOOR_FACTOR + 0.1) * sgd_floor}, {NOISY: sgd_floor}, run=sgd)
        )
        if v.scenario == sgd.id
    )
    assert v.status == "fail" and (v.step, v.param) == (2, NOISY) and "reach" not in v.message


def test_adamw_reach_is_the_largest_step_difference_adamw_can_make():
    """Two AdamW optimizers fed opposite worst-case gradients part by no more than adamw_reach, and the
    bound is tight at step 1 (one step of lr each way)."""
    import torch

    for grads in ([1.0, 1e-9, -3.0, 0.0, 2.0], [1e-8] * 5, [1.0, -1.0] * 3):
        a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        oa = torch.optim.AdamW([a], lr=0.01, betas=ADAMW_BETAS, eps=0.0, weight_decay=0.0)
        ob = torch.optim.AdamW([b], lr=0.01, betas=ADAMW_BETAS, eps=0.0, weight_decay=0.0)
        for t, g in enumerate(grads, 1):
            a.grad, b.grad = torch.tensor([g]), torch.tensor([-g if g else 1.0])
            oa.step(), ob.step()
            assert abs(float(a.detach() - b.detach())) <= adamw_reach(0.01, t) * (1 + 1e-6)
    assert abs(adamw_reach(0.01, 1) - 0.02) < 1e-12


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
    v = next(
        v
        for v in checks.split_matches_full_batch(
            tables({}, {}, batch_stats=layers, run=two, probe_diffs={HEALTHY: 2 * TIER})
        )
        if v.scenario == two.id
    )
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
    v = next(
        v
        for v in checks.split_matches_full_batch(tables({}, {}, batch_stats=layers, run=resumed))
        if v.scenario == resumed.id
    )
    assert v.status == "skip" and "does not apply" in v.message


def test_the_report_counts_the_model_sensitive_parameters_per_model():
    floor = 10 * TIER
    t = tables({NOISY: floor}, {NOISY: floor})
    table = sensitivity_table(t)
    assert set(table.sensitive) == {1} and set(table.params) == {2}
    assert all(NOISY in w for w in table.which)
    text = "\n".join(noise_section(t))
    assert "model-sensitive, held to its noise floor" in text and NOISY in text
    quiet = "\n".join(noise_section(tables({}, {})))
    assert "No parameter of any model is model-sensitive" in quiet
    assert noise_section({"scenarios": pd.DataFrame(), "params": pd.DataFrame()}) == []


def test_two_factorisations_hold_a_model_sensitive_parameter_as_split_data_does():
    """accum at W = 2 against the plain step at W = 4: the same 4 micro-batch gradients summed in another
    order, so a parameter whose floor (the probes' spread) is high is held to it, or to AdamW's reach;
    a healthy parameter keeps the tier's bound."""
    from harness.checks.features import factorisations_agree

    run = RUN.replace(world_size=2, feature="accum")
    assert [p.id for p in run.noise_probes()][-1].endswith("micro2rev")  # 4 gradients: a reversed probe too
    twin = run.factor_twin()
    floor = 10 * TIER

    def verdict_of(factor: dict) -> object:
        t = tables({}, {NOISY: floor}, run=run)
        extra = tables({}, {}, run=twin)  # the twin with its own probes
        t = {k: pd.concat([t[k], extra[k][~extra[k].scenario.isin(set(t[k].scenario))]], ignore_index=True) for k in t}
        p = t["params"]
        p["diff_factor"] = [factor.get(q, 0.0) if s == run.id else float("nan") for s, q in zip(p.scenario, p.param)]
        return next(v for v in factorisations_agree(t) if v.scenario == run.id)

    v = verdict_of({NOISY: 3 * floor})
    assert v.status == "pass" and "model-sensitive" in v.message and NOISY in v.message
    v = verdict_of({HEALTHY: 1.01 * TIER})
    assert v.status == "fail" and v.param == HEALTHY


def test_clipping_across_world_sizes_holds_a_parameter_the_nudged_probe_moves_to_its_floor():
    """Replicated data under L2 clipping: the sharded norm differs in its last bits, so a probe with the
    clipping coefficient nudged by W ulps measures each parameter's sensitivity to that; a parameter it
    moves is held to its floor (or AdamW's reach), a healthy one to the split tier's bound."""
    run = RUN.replace(data_mode="replicated", feature="clip", world_size=2)
    [probe] = run.noise_probes()
    assert probe.id.endswith("-clip-nudge2") and probe.micro_batches == 1
    split = run.replace(data_mode="split")
    assert [p.id.rsplit("-", 1)[-1] for p in split.noise_probes()] == ["micro2", "nudge2"]
    floor = 10 * TIER

    def verdict_of(ws1_diffs: dict, probe_floor: dict) -> object:
        t = tables({}, probe_floor, run=run)
        extra = tables({}, {}, run=run.ws1())
        t = {k: pd.concat([t[k], extra[k][extra[k].scenario == run.ws1().id]], ignore_index=True) for k in t}
        p = t["params"]
        p["diff_ws1"] = [ws1_diffs.get(q, 0.0) if s == run.id else 0.0 for s, q in zip(p.scenario, p.param)]
        return next(v for v in checks.cross_ws_replicated(t) if v.scenario == run.id)

    v = verdict_of({NOISY: 3 * floor}, {NOISY: floor})
    assert v.status == "pass" and "model-sensitive" in v.message
    v = verdict_of({NOISY: 3 * floor}, {})  # without the probe's floor the same difference fails
    assert v.status == "fail" and v.param == NOISY
    v = verdict_of({HEALTHY: 1.01 * TIER}, {NOISY: floor})
    assert v.status == "fail" and v.param == HEALTHY
