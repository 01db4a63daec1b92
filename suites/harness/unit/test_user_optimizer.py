"""The user's optimizer (`--optimizers package.module:factory`): parsed, loaded and held to its protocol
before anything runs; ids stay path- and shell-safe; the bounds, memory ideal and traffic of its runs are
stated for it (harness/core/policy.py [Note: user optimizer]); the zoo's normalised SGD steps by the whole
matrix's norm."""

from __future__ import annotations

import argparse
import shlex

import pandas as pd
import pytest
import torch

from harness import options as opt
from harness.checks import resources as resource_checks
from harness.core.policy import Bounds, not_exact
from harness.core.scenario import Scenario, user_optimizer
from harness.localize.replay import scenario_of_id
from harness.measure import ideal_state_bytes
from harness.optimizers import OptimizerError, check_optimizer, make_optimizer
from harness.preflight import checked_matrix
from harness.train.optim import NormalisedSGD
from suites.harness.unit.synthetic_tables import LOSSES, P_BYTES, ZERO
from suites.harness.unit.synthetic_tables import cell as _sc
from suites.harness.unit.synthetic_tables import check_tables as make

NSGD = "harness.train.optim:normalised_sgd"


def test_a_user_factory_is_an_optimizer_name_beside_the_built_in_ones():
    assert opt.optimizers(f"adamw,{NSGD}") == ("adamw", NSGD)
    assert user_optimizer(NSGD) and not user_optimizer("adamw") and not user_optimizer("sgd")
    p = torch.nn.Parameter(torch.zeros(2))
    assert isinstance(make_optimizer([p], NSGD, 0.1), NormalisedSGD)


@pytest.mark.parametrize(
    "name, says",
    [
        ("lamb", "unknown 'lamb'; choose from adamw, sgd, or name your own optimizer 'package.module:factory'"),
        ("no_such_pkg.optim:lion", "module 'no_such_pkg.optim' could not be imported"),
        ("harness.train.optim:lion", "module 'harness.train.optim' has no attribute 'lion'"),
        ("harness.optimizers:SGD_MOMENTUM", "SGD_MOMENTUM is a float, not a callable factory(params, lr=lr)"),
    ],
)
def test_a_bad_name_is_one_usage_error_line_at_parse_time(name, says):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        opt.optimizers(name)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "factory, says",
    [
        ("raising_optimizer", "factory(params, lr=0.01) raised RuntimeError: no optimizer here"),
        ("optimizer_returning_none", "returned NoneType, not a torch.optim.Optimizer"),
        ("optimizer_whose_step_raises", "step() raised RuntimeError: stuck"),
    ],
)
def test_a_factory_that_breaks_the_protocol_is_refused_before_any_world_starts(factory, says):
    name = f"suites.faults.bad_inputs:{factory}"
    with pytest.raises(OptimizerError) as err:
        check_optimizer(name, 0.01)
    assert says in str(err.value) and "\n" not in str(err.value)
    ns = argparse.Namespace(optimizers=(name,), impls=("fsdp_impl",), models=("mlp",), world_sizes=(1,))
    with pytest.raises(argparse.ArgumentTypeError, match="^--optimizers: "):
        checked_matrix(ns)  # as the CLI and the plugin build their matrix


def test_ids_spell_a_user_optimizer_path_and_shell_safe_and_read_back():
    sc = Scenario("fsdp_impl", "mlp", 2, "split", NSGD, steps=3)
    assert ":" not in sc.id and "/" not in sc.id and shlex.quote(sc.id) == sc.id
    assert sc.id == "fsdp_impl-mlp-ws2-split-harness.train.optim.normalised_sgd"
    assert scenario_of_id(sc.id, steps=3) == sc


def test_normalised_sgd_steps_each_tensor_by_its_whole_gradient_over_its_norm():
    w, b = torch.nn.Parameter(torch.ones(3, 4)), torch.nn.Parameter(torch.ones(2))
    g = torch.arange(12.0).reshape(3, 4)
    w.grad, b.grad = g.clone(), torch.zeros(2)  # a zero gradient leaves its tensor as it is
    NormalisedSGD([w, b], lr=0.5).step()
    assert torch.equal(w.detach(), torch.ones(3, 4) - g / torch.linalg.vector_norm(g) * 0.5)
    assert torch.equal(b.detach(), torch.ones(2))


def test_a_user_optimizer_is_held_as_l2_clipping_across_world_sizes_and_to_sgds_split_tier():
    b = Bounds()
    for name in ("adamw", "sgd"):  # unchanged for the built-in optimizers
        assert b.replicated_bound("plain", name, 0.01, 3) == (b.cross_ws_replicated, "")
        assert not not_exact("plain", name)
    bound, why = b.replicated_bound("plain", NSGD, 0.01, 3)
    assert bound == b.split_per_lr_step_sgd * 0.01 * 3 == b.split_bound(NSGD, 0.01, 3) == b.split_bound("sgd", 0.01, 3)
    assert "user's optimizer" in why and b.reach(NSGD, 0.01, 3) == 0.0
    assert b.split_bound("adamw", 0.01, 3) == b.split_per_lr_step_adamw * 0.01 * 3


def test_a_user_optimizers_runs_get_nudged_probes_in_both_data_modes_and_the_built_in_ones_do_not():
    rep = Scenario("fsdp_impl", "bn_mlp", 4, "replicated", NSGD)
    assert [(p.micro_batches, p.nudge) for p in rep.noise_probes()] == [(1, 4)]
    assert all(p.impl == "reference" and p.optimizer == NSGD for p in rep.noise_probes())
    split = Scenario("fsdp_impl", "bn_mlp", 4, "split", NSGD)
    assert [(p.micro_batches, p.reverse_micro, p.nudge) for p in split.noise_probes()] == [
        (4, False, 0),
        (4, True, 0),
        (4, False, 4),
    ]
    for name in ("adamw", "sgd"):
        assert Scenario("fsdp_impl", "bn_mlp", 4, "replicated", name).noise_probes() == []
        assert all(not p.nudge for p in Scenario("fsdp_impl", "bn_mlp", 4, "split", name).noise_probes())


def test_a_nudged_probe_scales_every_gradient_the_optimizer_reads_by_w_ulps():
    from harness.train.task import nudge_grads

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.tensor([1.0, -3.0, 0.5])
    nudge_grads(torch.optim.SGD([w], lr=0.1), 4)
    assert torch.equal(w.grad, torch.tensor([1.0, -3.0, 0.5]) * (1 + 4 * 2.0**-23))


def test_the_measured_reach_is_twice_the_furthest_travel_of_the_plain_models_runs():
    from harness.checks.noise_floor import held_bounds, measured_reach, probe_maxima

    run = Scenario("fsdp_impl", "bn_mlp", 2, "split", NSGD)
    ref, probes = run.reference(), run.noise_probes()
    rows = [
        (ref.id, 1, "b", 0.01),
        (ref.id, 2, "b", 0.01),
        (ref.id, 1, "w", 0.001),
        (ref.id, 2, "w", 0.002),
        (probes[0].id, 1, "b", 0.01),
        (probes[0].id, 2, "b", 0.02),  # a probe that travelled further
        (run.id, 1, "b", 1.0),
    ]  # an implementation's run never sets the reach
    params = pd.DataFrame(
        [
            {
                "scenario": s,
                "step": k,
                "param": q,
                "numel": 3,
                "diff_ref": 0.0,
                "diff_ws1": 0.0,
                "sum": 0.0,
                "travel": t,
            }
            for s, k, q, t in rows
        ]
    )
    scen = pd.DataFrame(
        [
            {"scenario": s.id, "impl": s.impl, "micro_batches": s.micro_batches, "nudge": s.nudge}
            for s in (ref, *probes, run)
        ]
    )
    reach = measured_reach(probe_maxima({"scenarios": scen, "params": params}), [ref, *probes])
    assert reach == pytest.approx({"b": 2 * 0.03, "w": 2 * 0.003})
    # it lifts a model-sensitive parameter only: a healthy one keeps the tier's bound
    assert held_bounds({"b": 0.005, "w": 1e-9}, 3e-6, 0.0, reach) == pytest.approx({"b": 0.06, "w": 3e-6})


def test_ideal_state_takes_a_measured_factor_and_refuses_to_guess():
    assert ideal_state_bytes(800, NSGD, 4, state_factor=0.0)["optimizer_state"] == 0
    assert ideal_state_bytes(800, NSGD, 4, state_factor=2.0)["optimizer_state"] == 400
    with pytest.raises(ValueError, match="needs its measured state_factor"):
        ideal_state_bytes(800, NSGD, 4)


def _memory(*runs):
    """runs: (scenario, ws, optimizer-state bytes per rank); params and grads at their ideal."""
    rows = []
    for sc, ws, state in runs:
        per = P_BYTES // ws
        rows += [
            (sc.id, 0, "state_params", per),
            (sc.id, 0, "state_grads", per),
            (sc.id, 0, "state_optimizer_state", state),
            (sc.id, 0, "state_buffers", 0),
            (sc.id, 0, "state_other", 0),
        ]
    return pd.DataFrame(rows, columns=["scenario", "rank", "category", "bytes"])


@pytest.mark.parametrize("factor", [0, 3])
def test_a_user_optimizers_state_ideal_is_what_its_plain_reference_run_holds(factor):
    """No factor is guessed from the name: a stateless optimizer's sharded run holding nothing passes, and so
    does one whose reference holds 3 bytes per parameter byte when the run holds a quarter of that at 4 ranks;
    state kept whole on every rank fails; a reference that recorded none leaves nothing to hold it to."""
    sc = _sc("fsdp_impl", 4, opt=NSGD)
    ref = sc.reference()
    t = make([(sc, LOSSES, ZERO, ZERO), (ref, LOSSES, ZERO, ZERO)])
    t["memory"] = _memory((sc, 4, factor * P_BYTES // 4), (ref, 1, factor * P_BYTES))
    assert {v.scenario: v.status for v in resource_checks.memory_sharding(t)}[sc.id] == "pass"
    t["memory"] = _memory((sc, 4, factor * P_BYTES + 4096), (ref, 1, factor * P_BYTES))
    v = {v.scenario: v for v in resource_checks.memory_sharding(t)}[sc.id]
    assert v.status == "fail" and v.where.startswith("optimizer_state")
    t["memory"] = _memory((sc, 4, 0))
    v = {v.scenario: v for v in resource_checks.memory_sharding(t)}[sc.id]
    assert v.status == "fail" and f"{ref.id} recorded none" in v.message


def test_a_user_optimizers_norm_all_reduce_is_one_element_per_tensor_and_no_more():
    P_EL = P_BYTES // 4
    sc = _sc("fsdp_impl", 4, opt=NSGD)
    t = make([(sc, LOSSES, ZERO, ZERO)])
    tensors = int(t["scenarios"].param_tensors.iloc[0])

    def rows(n):
        return pd.DataFrame(
            [
                (sc.id, "all_gather", "float32", 4, 1, 2 * P_EL, 8 * P_EL),
                (sc.id, "reduce_scatter", "float32", 4, 1, P_EL, 4 * P_EL),
                (sc.id, "all_reduce", "float32", 4, n, n, 4 * n),
            ],
            columns=t["comm"].columns,
        )

    t["comm"] = rows(tensors)
    [v] = resource_checks.comm_volume(t)
    assert v.status == "pass" and "optimizer norm's all_reduce" in v.message
    t["comm"] = rows(tensors + P_EL // 2)  # beyond the norms: half the gradient all-reduced
    v = resource_checks.comm_volume(t)[0]
    assert v.status == "fail" and "gradients reduced by all_reduce" in v.where
    t["scenarios"]["optimizer"] = "adamw"  # the built-in optimizers all-reduce no norm
    t["comm"] = rows(tensors)
    assert "optimizer norm's" not in resource_checks.comm_volume(t)[0].message
