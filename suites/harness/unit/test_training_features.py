"""The features that change how a run is made: ckpt (resumed from a checkpoint saved at another world
size), bf16 (mixed precision, a derived bound), hsdp (a replicate x shard mesh). Scenario arithmetic
and checks on hand-made tables here; a small run through FSDP2 and fsdp_impl at the end."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest

from harness.checks import features as feature_checks
from harness.checks import numeric
from harness.core.features import hsdp_mesh
from harness.core.policy import Bounds
from harness.core.scenario import Scenario, build_matrix, ckpt_step
from suites.harness.unit.synthetic_tables import LOSSES, ZERO, check_tables


def test_a_ckpt_cell_resumes_from_every_other_world_size_and_goes_on_like_the_uninterrupted_run():
    cells = build_matrix(["fsdp_impl"], ["mlp"], [1, 2, 4], ["replicated"], ["adamw"], features=("ckpt",))
    resumed = sorted((c.world_size, c.resume_from) for c in cells if c.feature == "ckpt")
    assert resumed == [(1, 2), (1, 4), (2, 1), (2, 4), (4, 1), (4, 2)]
    sc = next(c for c in cells if (c.world_size, c.resume_from) == (4, 2))
    assert sc.id == "fsdp_impl-mlp-ws4-replicated-adamw-ckpt-from2"
    assert {d.id for d in sc.dependencies()} == {
        "reference-mlp-ws1-replicated-adamw",  # the plain model, uninterrupted
        "fsdp_impl-mlp-ws1-replicated-adamw",  # the implementation at one rank, uninterrupted
        "fsdp_impl-mlp-ws2-replicated-adamw",
    }  # the saver
    assert all(d in cells for d in sc.dependencies())
    one = build_matrix(["fsdp_impl"], ["mlp"], [2], ["split"], ["sgd"], features=("ckpt",))
    assert [c.resume_from for c in one if c.feature == "ckpt"] == [2]  # one world size: saved and loaded there
    assert ckpt_step(10) == 5 and ckpt_step(3) == 1


def test_bf16_is_compared_with_the_plain_model_in_bf16_which_is_compared_with_fp32():
    cells = build_matrix(["torch_fsdp2"], ["mlp"], [2], ["replicated", "split"], ["adamw"], features=("bf16",))
    replicated = next(c for c in cells if c.world_size == 2 and c.data_mode == "replicated")
    assert replicated.reference().id == "reference-mlp-ws1-replicated-adamw-bf16"
    assert replicated.reference().reference().id == "reference-mlp-ws1-replicated-adamw"
    # split data: the plain bf16 model summing the two ranks' micro-batches, itself held against fp32
    split = next(c for c in cells if c.world_size == 2 and c.data_mode == "split")
    assert split.reference().id == "reference-mlp-ws1-replicated-adamw-bf16-micro2"
    assert split.reference().reference().id == "reference-mlp-ws1-replicated-adamw"
    assert split.ws1().reference().id == "reference-mlp-ws1-replicated-adamw-bf16"  # one rank: the whole batch
    assert {c.id for c in cells if c.impl == "reference"} == {
        replicated.reference().id,
        split.reference().id,
        replicated.reference().reference().id,
    }
    row = pd.DataFrame(
        [
            dict(
                impl="reference",
                model="mlp",
                world_size=1,
                data_mode="replicated",
                optimizer="adamw",
                seed=0,
                feature="bf16",
                micro_batches=2,
            )
        ]
    ).iloc[0]
    assert Scenario.of_row(row) == split.reference()  # the column reads back
    assert Scenario.of_row(row.drop("micro_batches")).micro_batches == 1  # a table stored before it existed


def test_the_micro_batch_reference_takes_the_slices_the_ranks_take_in_rank_order():
    import torch

    from harness.train.data import local_slice
    from harness.train.features import forward_backward, rank_slices

    x, y = torch.arange(8.0).reshape(8, 1), torch.arange(8)
    for w in (2, 4):
        got = rank_slices(x, y, w)
        assert [m[0].flatten().tolist() for m in got] == [
            local_slice(x, y, r, w, "split")[0].flatten().tolist() for r in range(w)
        ]
    seen = []

    class Spec:
        def loss(self, out, target):
            seen.append(target.tolist())
            return out.sum()

    model = torch.nn.Linear(1, 1, bias=False)
    forward_backward("bf16", Spec(), model, x, y, micro=4)
    assert seen == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert model.weight.grad.item() == pytest.approx(x.sum().item() / 4)  # each loss scaled by 1/4
    # a feature with micro-batches of its own cuts each rank's slice as that rank does (the noise probe of
    # accum at W = 2: four micro-batches, each loss scaled by 1/4)
    seen.clear()
    model.weight.grad = None
    forward_backward("accum", Spec(), model, x, y, micro=2)
    assert seen == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert model.weight.grad.item() == pytest.approx(x.sum().item() / 4)


def test_the_hybrid_mesh_has_two_replicas_wherever_the_world_divides():
    assert [hsdp_mesh(w) for w in (1, 2, 3, 4, 8)] == [(1, 1), (2, 1), (1, 3), (2, 2), (2, 4)]
    sc = Scenario("fsdp_impl", "mlp", 4, "replicated", "adamw", feature="hsdp")
    assert sc.reference().feature == "plain"  # a layout: the numbers must be the plain step's


def _with(tables, **columns_by_id):
    """Set scenario columns: _with(t, feature={id: "ckpt"}, resume_from={id: 2})."""
    sc = tables["scenarios"]
    for col, values in columns_by_id.items():
        sc[col] = [values.get(s, sc[col].iloc[i] if col in sc else None) for i, s in enumerate(sc.scenario)]
    return tables


def _resumed_tables(restore_diff, state_diff=0.0, where=""):
    loader = Scenario("fsdp_impl", "mlp", 1, "split", "adamw", steps=3, feature="ckpt", resume_from=2)
    t = check_tables([(loader.reference(), LOSSES, ZERO, ZERO), (loader, LOSSES, ZERO, ZERO)])
    return _with(
        t,
        feature={loader.id: "ckpt"},
        resume_from={loader.id: 2},
        restore_diff={loader.id: restore_diff},
        state_restore_diff={loader.id: state_diff},
        state_restore_param={loader.id: "layers.0.weight" if state_diff else ""},
        state_restore_rank={loader.id: 0 if state_diff else math.nan},
        state_restore_where={loader.id: where},
        state_restored={loader.id: "exp_avg of 1 parameters"},
    ), loader


@pytest.mark.parametrize(
    "diff, state, status",
    [
        (0.0, 0.0, "pass"),
        (1e-7, 0.0, "fail"),
        (math.nan, 0.0, "fail"),
        (0.0, 1.0, "fail"),
        (0.0, math.inf, "fail"),
        (0.0, math.nan, "fail"),
    ],
)
def test_ckpt_restored_holds_the_loaded_parameters_and_optimizer_state_bitwise_to_the_saved_ones(diff, state, status):
    tables, loader = _resumed_tables(diff, state, where="layers.0.weight step on rank 0: 0 after loading, 1 saved")
    [v] = feature_checks.ckpt_restored(tables)
    assert v.status == status and v.scenario == loader.id
    if status == "fail":
        unmeasured = math.isnan(diff) or math.isnan(state)
        assert ("could not be checked" in v.message) == unmeasured
        assert v.step == (None if unmeasured else ckpt_step(3))
        if not unmeasured and state:  # the optimizer state's worst element, named with its rank
            assert v.param == "layers.0.weight" and v.rank == 0 and "step on rank 0: 0 after loading" in v.message


def test_a_run_resumed_from_two_ranks_is_held_to_two_ranks_bounds_not_to_bitwise_one_rank():
    """Its first steps were trained at two ranks on split data: not exact, so ws1_exact does not apply
    to it, split_matches_full_batch does."""
    tables, loader = _resumed_tables(0.0)
    assert not [v for v in numeric.ws1_exact(tables) if v.scenario == loader.id]
    [v] = [v for v in numeric.split_matches_full_batch(tables) if v.scenario == loader.id]
    assert v.status == "pass"


def _bf16_tables(drift, diff):
    """The bf16 plain model `drift` from fp32 at every step; a sharded bf16 split run `diff` from the plain
    bf16 model summing its two ranks' micro-batches."""
    sc = Scenario("torch_fsdp2", "mlp", 2, "split", "sgd", steps=3, feature="bf16")
    bf16_ref, fp32_ref = sc.reference(), sc.reference().reference()
    t = check_tables(
        [(fp32_ref, LOSSES, ZERO, ZERO), (bf16_ref, LOSSES, [drift] * 3, ZERO), (sc, LOSSES, [diff] * 3, ZERO)]
    )
    return _with(t, feature={bf16_ref.id: "bf16", sc.id: "bf16"}, micro_batches={bf16_ref.id: 2}), sc


@pytest.mark.parametrize("of_bound, status", [(0.0, "pass"), (0.5, "pass"), (1.0, "fail"), (math.nan, "fail")])
def test_under_bf16_split_data_is_held_by_the_split_bound_against_the_micro_batch_reference(of_bound, status):
    """The same bf16 addends as the plain bf16 model summing the ranks' micro-batches, summed in another
    order at most: the split tier's bound, as in fp32; the step-1 norm to the fp32 bound."""
    from harness.checks.norms import grad_norm_matches

    bound = Bounds().split_bound("sgd", 1e-2, 3)
    tables, sc = _bf16_tables(1e-4, of_bound * bound)
    [v] = [v for v in numeric.split_matches_full_batch(tables) if v.scenario == sc.id]
    assert v.status == status and v.bound == bound and "in 2 micro-batches" in v.message
    for norm, ok in ((1.0 + 5e-7, "pass"), (1.0 + 2e-6, "fail")):  # check_tables: grad_norm 1.0 everywhere
        tables["steps"].loc[tables["steps"].scenario == sc.id, "grad_norm"] = norm
        [v] = [v for v in grad_norm_matches(tables) if v.scenario == sc.id]
        assert v.status == ok and v.bound == Bounds().grad_norm_rel  # no bf16 allowance: the same addends


@pytest.mark.parametrize("diff, status", [(0.0, "pass"), (5e-6, "fail")])
def test_two_factorisations_of_the_global_batch_must_agree_within_the_split_bound(diff, status):
    sc = Scenario("fsdp_impl", "mlp", 1, "split", "sgd", steps=3, feature="no_sync")
    twin = sc.factor_twin()
    assert (twin.world_size, twin.feature) == (2, "plain")
    tables = _with(
        check_tables([(sc.reference(), LOSSES, ZERO, ZERO), (sc, LOSSES, ZERO, ZERO), (twin, LOSSES, ZERO, ZERO)]),
        feature={sc.id: "no_sync", twin.id: "plain"},
    )
    params = tables["params"]
    params["diff_factor"] = [
        (diff if p == "fc2.weight" else 0.0) if s == sc.id else math.nan for s, p in zip(params.scenario, params.param)
    ]
    [v] = feature_checks.factorisations_agree(tables)
    assert v.scenario == sc.id and v.status == status  # the split bound for SGD, 3 steps: 3e-6
    if status == "fail":
        assert (v.step, v.param) == (1, "fc2.weight")
    alone = {k: t[t.scenario != twin.id] if "scenario" in t else t for k, t in tables.items()}
    [v] = feature_checks.factorisations_agree(alone)
    assert v.status == "skip" and twin.id in v.message


@pytest.mark.parametrize("differ, status", [(0.0, "pass"), (2.0, "fail"), (math.nan, "fail")])
def test_replicas_agree_needs_every_rank_to_hold_its_first_replicas_parameters(differ, status):
    sc = Scenario("fsdp_impl", "mlp", 4, "replicated", "adamw", steps=3, feature="hsdp")
    tables = _with(check_tables([(sc, LOSSES, ZERO, ZERO)]), feature={sc.id: "hsdp"})
    tables["steps"]["replicas_differ"] = [0.0, differ, 0.0]
    [v] = feature_checks.replicas_agree(tables)
    assert v.status == status
    if status == "fail":
        assert ("could not be checked" in v.message) == math.isnan(differ)
        assert v.step == (None if math.isnan(differ) else 2)


def test_bf16_acts_fails_a_policy_that_changes_nothing():
    for drift, status in ((1e-4, "pass"), (0.0, "fail")):
        tables, sc = _bf16_tables(drift, 0.0)
        [v] = feature_checks.bf16_acts(tables)
        assert v.scenario == sc.reference().id and v.status == status


class LoadsNothing:
    """FSDP2 whose load_checkpoint does nothing: a resumed run starts from its fresh initial weights."""

    def __new__(cls):
        from harness.adapters.torch_fsdp2 import TorchFSDP2Adapter

        adapter = TorchFSDP2Adapter()
        adapter.name = "loads_nothing"
        adapter.load_checkpoint = lambda wrapped, optimizer, path: None
        return adapter


@pytest.mark.ci  # 18 scenarios; the mutant catalogue's ckpt faults and the bf16 compositions hold it quicker
def test_split_bf16_and_resumed_runs_hold_and_a_checkpoint_never_loaded_fails_where_it_was_loaded(kept_worlds):
    from harness.phases import run_matrix

    impls = ["fsdp_impl", "torch_fsdp2", f"{__name__}:LoadsNothing"]
    cells = build_matrix(impls, ["mlp"], [1, 2], ["split"], ["sgd"], steps=3, features=("bf16", "ckpt", "no_sync"))
    res = run_matrix(cells, pool=kept_worlds)
    broken = [v for v in res.failed if "LoadsNothing" in v.scenario]
    assert not [str(v) for v in res.failed if v not in broken]
    restored = [v for v in broken if v.check == "ckpt_restored"]
    assert {v.scenario for v in restored} == {c.id for c in cells if "LoadsNothing" in c.impl and c.resume_from}
    assert all(v.step == ckpt_step(3) for v in restored)
    # at 2 ranks the fp32 sum of two bf16 gradients is rounded once whatever the order: bitwise the plain
    # bf16 model summing the same two micro-batches (harness/core/policy.py, BF16_SPLIT)
    bf16 = [v for v in res.verdicts if v.check == "split_matches_full_batch" and v.scenario.endswith("-bf16")]
    assert len(bf16) == 3 and all(v.status == "pass" and v.measured == 0.0 for v in bf16)
    norms = [v for v in res.verdicts if v.check == "grad_norm_matches" and v.scenario.endswith("ws2-split-sgd-bf16")]
    assert len(norms) == 3 and all(v.status == "pass" for v in norms)
    # one rank x 2 micro-batches against 2 ranks x 1, for each implementation; at 2 ranks the partner (4) is not run
    factored = {v.scenario: v for v in res.verdicts if v.check == "factorisations_agree"}
    assert {s for s, v in factored.items() if v.status == "pass"} == {
        c.id for c in cells if c.feature == "no_sync" and c.world_size == 1 and c.impl != "reference"
    }
    assert all(v.status == "skip" and "not in this run" in v.message for v in factored.values() if v.status != "pass")


class ReduceDtypeNone:
    """FSDP2 whose mixed-precision policy leaves reduce_dtype None, a real misconfiguration: FSDP2 then
    reduces in param_dtype, bf16, so every averaged gradient element keeps 8 significant bits."""

    def __new__(cls):
        from harness.adapters.torch_fsdp2 import TorchFSDP2Adapter

        adapter = TorchFSDP2Adapter()
        adapter.name = "reduce_dtype_none"
        wrap = adapter.wrap
        adapter.wrap = lambda model, units, *, options, **kw: wrap(
            model, units, options=dataclasses.replace(options, reduce_dtype=None), **kw
        )
        return adapter


def test_fsdp2_reducing_in_bf16_is_caught_by_split_data_against_the_micro_batch_reference(kept_worlds):
    """With replicated data the bf16 sum of equal bf16 addends is exact, so only split data shows it: against
    the plain bf16 model summing the two ranks' micro-batches (a full-batch yardstick, 2^-8 apart by
    itself, let it pass)."""
    from harness.phases import run_matrix

    cells = build_matrix(
        [f"{__name__}:ReduceDtypeNone"],
        ["tinylm"],
        [1, 2],
        ["replicated", "split"],
        ["adamw"],
        steps=3,
        features=("bf16",),
    )
    failed = {(v.check, v.scenario.split("-", 2)[-1]) for v in run_matrix(cells, pool=kept_worlds).failed}
    assert failed == {
        ("split_matches_full_batch", "ws2-split-adamw-bf16"),
        ("grad_norm_matches", "ws2-split-adamw-bf16"),
    }


def test_the_report_groups_resumed_runs_by_the_world_size_their_checkpoint_came_from():
    from harness.report.groups import cells_of, group_label, group_reference, groups_of

    cells = build_matrix(["fsdp_impl"], ["mlp"], [1, 2, 4], ["replicated"], ["adamw"], features=("ckpt",))
    rows = [
        dict(
            scenario=c.id,
            impl=c.impl,
            model=c.model,
            world_size=c.world_size,
            data_mode=c.data_mode,
            optimizer=c.optimizer,
            seed=c.seed,
            feature=c.feature,
            resume_from=c.resume_from,
        )
        for c in cells
    ]
    groups = {group_label(k): sorted(g.world_size) for k, g in groups_of(cells_of({"scenarios": pd.DataFrame(rows)}))}
    assert groups == {
        "fsdp_impl · mlp · replicated · adamw": [1, 2, 4],
        "fsdp_impl · mlp · replicated · adamw · ckpt from 1": [2, 4],
        "fsdp_impl · mlp · replicated · adamw · ckpt from 2": [1, 4],
        "fsdp_impl · mlp · replicated · adamw · ckpt from 4": [1, 2],
    }
    key = ("fsdp_impl", "mlp", "replicated", "adamw", "ckpt from 2", 0)
    assert group_reference(pd.DataFrame(rows), key) == "reference-mlp-ws1-replicated-adamw"


def test_the_report_names_each_world_sizes_micro_batch_reference_under_bf16_split_data():
    from harness.report.groups import references_per_ws

    split = ("fsdp_impl", "mlp", "split", "adamw", "bf16", 0)
    assert references_per_ws(split, [1, 2, 4]) == {
        2: "reference-mlp-ws1-replicated-adamw-bf16-micro2",
        4: "reference-mlp-ws1-replicated-adamw-bf16-micro4",
    }
    assert references_per_ws(("fsdp_impl", "mlp", "replicated", "adamw", "bf16", 0), [1, 2, 4]) == {}
    assert references_per_ws(("fsdp_impl", "mlp", "split", "adamw", "plain", 0), [1, 2, 4]) == {}
