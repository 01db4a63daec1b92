"""The feature axis: what one training step does (harness/core/scenario.py, harness/train/features.py)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from harness.checks import resources
from harness.core.features import ACCUM_MICRO_BATCHES
from harness.core.scenario import Scenario, build_matrix
from harness.train.features import forward_backward, micro_batches
from harness.train.models import get_model_spec


def test_plain_ids_are_unchanged_and_a_feature_is_named_before_the_seed():
    sc = Scenario("fsdp_impl", "mlp", 4, "split", "adamw", seed=3)
    assert sc.id == "fsdp_impl-mlp-ws4-split-adamw-seed3"
    assert sc.replace(feature="accum").id == "fsdp_impl-mlp-ws4-split-adamw-accum-seed3"


def test_a_feature_is_compared_with_the_plain_model_doing_the_same():
    cells = build_matrix(["fsdp_impl"], ["mlp"], [2], ["split"], ["sgd"], features=("plain", "accum"))
    refs = {c.id for c in cells if c.impl == "reference"}
    # each with its noise probe: the same step on the two ranks' slices (split data at W = 2); with the
    # feature's own micro-batches 4 gradients are summed, so a second probe sums them in reverse order
    assert refs == {
        "reference-mlp-ws1-replicated-sgd",
        "reference-mlp-ws1-replicated-sgd-accum",
        "reference-mlp-ws1-replicated-sgd-micro2",
        "reference-mlp-ws1-replicated-sgd-accum-micro2",
        "reference-mlp-ws1-replicated-sgd-accum-micro2rev",
    }
    accum = next(c for c in cells if c.feature == "accum" and c.world_size == 2)
    assert {d.id for d in accum.dependencies()} == {
        "reference-mlp-ws1-replicated-sgd-accum",
        "reference-mlp-ws1-replicated-sgd-accum-micro2",
        "reference-mlp-ws1-replicated-sgd-accum-micro2rev",
        "fsdp_impl-mlp-ws1-split-sgd-accum",
    }
    # beyond two ranks a second probe sums the slices in reverse order; replicated data has none
    at4 = Scenario("fsdp_impl", "mlp", 4, "split", "sgd", feature="ckpt", resume_from=8)
    assert [p.id for p in at4.noise_probes()] == [
        "reference-mlp-ws1-replicated-sgd-micro4",
        "reference-mlp-ws1-replicated-sgd-micro4rev",
        "reference-mlp-ws1-replicated-sgd-micro8",
        "reference-mlp-ws1-replicated-sgd-micro8rev",
    ]
    assert at4.replace(data_mode="replicated").noise_probes() == []
    # bf16 is compared with the rank-order micro-batch run itself: only the reversed probe is left to run
    bf16 = at4.replace(feature="bf16", resume_from=0)
    assert [p.id for p in bf16.noise_probes()] == ["reference-mlp-ws1-replicated-sgd-bf16-micro4rev"]
    assert bf16.at_world_size(2).noise_probes() == []


def test_a_row_stored_before_features_existed_reads_as_plain():
    row = pd.Series(
        {"impl": "fsdp_impl", "model": "mlp", "world_size": 2, "data_mode": "split", "optimizer": "adamw", "seed": 0}
    )
    assert Scenario.of_row(row).feature == "plain"
    assert Scenario.of_row(pd.Series({**row.to_dict(), "feature": "accum"})).feature == "accum"


def test_micro_batches_are_equal_views_and_an_uneven_batch_is_refused():
    x, y = torch.arange(8.0).reshape(4, 2), torch.arange(4)
    parts = micro_batches(x, y, 2)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert parts[0][0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="does not split into 3 equal micro-batches"):
        micro_batches(x, y, 3)


def test_accumulated_micro_batches_give_the_whole_batch_gradient_up_to_rounding():
    """The feature is a faithful accumulation: k scaled micro-batch gradients sum to the batch's."""
    spec = get_model_spec("mlp")
    grads = {}
    for feature in ("plain", "accum"):
        torch.manual_seed(0)
        model = spec.build()
        x, y = spec.make_batch(8, 1, 0)
        loss = forward_backward(feature, spec, model, x, y)
        grads[feature] = (float(loss), [p.grad.clone() for p in model.parameters()])
    assert grads["plain"][0] == pytest.approx(grads["accum"][0], rel=1e-6)
    for a, b in zip(grads["plain"][1], grads["accum"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert ACCUM_MICRO_BATCHES == 2


def _comm_tables(feature: str, passes: int):
    p = 1000
    sc = Scenario("fsdp_impl", "mlp", 2, "replicated", "adamw", feature=feature)
    scen = pd.DataFrame(
        [
            {
                "scenario": sc.id,
                "impl": sc.impl,
                "model": sc.model,
                "world_size": 2,
                "data_mode": "replicated",
                "optimizer": "adamw",
                "seed": 0,
                "feature": feature,
                "status": "ok",
                "sharded": True,
                "param_bytes": 4 * p,
                "row_bytes": 0,
                "param_tensors": 1,
                "param_elements": p,
                "trainable_elements": p,
            }
        ]
    )
    comm = pd.DataFrame(
        [
            {
                "scenario": sc.id,
                "collective": "all_gather",
                "dtype": "float32",
                "calls": 2 * passes,
                "elements": 2 * p * passes,
                "bytes": 8 * p * passes,
            },
            {
                "scenario": sc.id,
                "collective": "reduce_scatter",
                "dtype": "float32",
                "calls": passes,
                "elements": p * passes,
                "bytes": 4 * p * passes,
            },
        ]
    )
    return {"scenarios": scen, "comm": comm}


def test_traffic_is_held_to_one_gather_and_reduction_per_micro_batch():
    assert [v.status for v in resources.comm_volume(_comm_tables("accum", ACCUM_MICRO_BATCHES))] == ["pass"]
    [v] = resources.comm_volume(_comm_tables("accum", 1))  # a reduction skipped on one micro-batch
    assert v.status == "fail" and f"!= {ACCUM_MICRO_BATCHES} x P =" in v.where
    [v] = resources.comm_volume(_comm_tables("plain", ACCUM_MICRO_BATCHES))
    assert v.status == "fail"


def test_a_feature_the_adapter_cannot_do_is_unsupported_not_run_and_never_a_pass(tmp_path):
    from harness.checks.numeric import completed
    from harness.execute.executor import execute
    from harness.report import markdown as report
    from harness.tables.build import build_tables

    class NoPool:
        worlds_started = 0

        def run_scenario(self, sc, payload):
            raise AssertionError(f"{sc.id} was run")

    sc = Scenario("torch_fsdp1", "mlp", 2, "replicated", "adamw", feature="no_sync")
    records = execute([sc], snapshot_dir=tmp_path, pool=NoPool())
    assert "has no set_gradient_sync() method, which feature 'no_sync' needs" in records[sc.id]["unsupported"]
    tables = build_tables([sc], records)
    assert tables["scenarios"].status.tolist() == ["unsupported"]
    [v] = completed(tables)
    assert v.status == "unsupported" and not v.passed
    tables["verdicts"] = [v]
    text = report.write_report(tables, {}, tmp_path / "r.md").read_text()
    assert "1 unsupported (not run)" in text and "## Unsupported" in text and "Overall: PASS" not in text


def test_a_scenario_that_fails_as_the_plain_model_fails_is_the_models_limit_not_the_implementations():
    from harness.core.outcome import outcome
    from harness.tables.build import build_tables

    sc = Scenario("fsdp_impl", "bn_mlp", 2, "replicated", "adamw", feature="bf16")
    ref = sc.reference()
    boom = 'Traceback (most recent call last):\n  File "m.py", line 1\nRuntimeError: expected scalar type BFloat16 but found Float\n'
    other = "Traceback (most recent call last):\nRuntimeError: shard offset out of range\n"
    tables = build_tables([ref, sc], {ref.id: {"error": boom}, sc.id: {"error": boom}})
    status = dict(zip(tables["scenarios"].scenario, tables["scenarios"].status))
    errors = dict(zip(tables["scenarios"].scenario, tables["scenarios"].error))
    assert status == {ref.id: "error", sc.id: "unsupported"}
    assert errors[sc.id].startswith("model limit: fails as the plain model fails in " + ref.id)
    assert errors[ref.id].startswith("model limit: the plain model itself fails") and "BFloat16" in errors[ref.id]
    # the yardstick is broken (its scenario errored), so the run is a failure, not a skip (harness.core.outcome);
    # the implementation's own cell did not run (unsupported: the model's limit, not the implementation's fault)
    out = outcome(tables["scenarios"], pd.DataFrame(columns=["scenario", "check", "status", "message"]))
    assert out.word == "FAIL" and out.impls[0].unsupported == 1 and out.errored == 1
    # raised on one rank of a larger world, the others reporting they failed too
    multi = (
        "rank 0 of World(8) failed:\n"
        + boom
        + "rank 7 failed too: RuntimeError: expected scalar type BFloat16 but found Float\n"
    )
    tables = build_tables([ref, sc], {ref.id: {"error": boom}, sc.id: {"error": multi}})
    assert dict(zip(tables["scenarios"].scenario, tables["scenarios"].status))[sc.id] == "unsupported"
    # another error than the plain model's is the implementation's own failure
    tables = build_tables([ref, sc], {ref.id: {"error": boom}, sc.id: {"error": other}})
    assert dict(zip(tables["scenarios"].scenario, tables["scenarios"].status))[sc.id] == "error"


def test_the_built_in_adapters_declare_what_they_support():
    from harness.adapters import load_adapter
    from harness.adapters.base import missing_capability

    for name in ("reference", "fsdp_impl", "torch_fsdp2", "ddp"):
        for feature in ("no_sync", "clip", "clip_inf"):
            assert missing_capability(load_adapter(name), feature) is None, (name, feature)
    for name in ("fsdp_impl", "torch_fsdp2"):  # everything
        assert all(missing_capability(load_adapter(name), f) is None for f in ("ckpt", "bf16", "hsdp")), name
    assert missing_capability(load_adapter("ddp"), "ckpt") is None  # a full checkpoint: DDP holds everything
    assert "wrap_hybrid()" in missing_capability(load_adapter("ddp"), "hsdp")
    assert missing_capability(load_adapter("reference"), "bf16") is None  # the plain model under the policy
    assert "save_checkpoint() or load_checkpoint()" in missing_capability(load_adapter("torch_fsdp1"), "ckpt")
    assert missing_capability(load_adapter("torch_fsdp1"), "no_sync")
    assert "clip_grad_norm()" in missing_capability(load_adapter("torch_fsdp1"), "clip")
    assert all(missing_capability(load_adapter("torch_fsdp1"), f) is None for f in ("plain", "accum"))


def _clip_tables(ref_norms, norms, feature="clip"):
    from suites.harness.unit.synthetic_tables import frame

    cells = [Scenario("fsdp_impl", "mlp", 2, "replicated", "adamw", steps=len(norms), feature=feature)]
    cells.insert(0, cells[0].reference())
    scen, steps = [], []
    for sc, values in zip(cells, (ref_norms, norms)):
        scen.append(
            dict(
                scenario=sc.id,
                impl=sc.impl,
                model=sc.model,
                world_size=sc.world_size,
                data_mode=sc.data_mode,
                optimizer=sc.optimizer,
                seed=0,
                feature=feature,
                status="ok",
                steps=sc.steps,
                lr=sc.lr,
            )
        )
        steps += [dict(scenario=sc.id, step=k + 1, loss=1.0, clip_norm=v) for k, v in enumerate(values)]
    return {"scenarios": frame("scenarios", scen), "steps": frame("steps", steps)}, cells[1].id


def test_clip_acts_requires_clipping_to_act_and_the_global_norm():
    from harness.checks.norms import clip_acts

    tables, sid = _clip_tables([0.5, 0.4, 0.3], [0.5, 0.4, 0.3])
    assert {v.scenario: v.status for v in clip_acts(tables)}[sid] == "pass"
    tables, sid = _clip_tables([0.5, 0.4, 0.3], [0.5 / 2**0.5, 0.4, 0.3])  # one rank's shard: off by sqrt(2)
    v = {v.scenario: v for v in clip_acts(tables)}[sid]
    assert v.status == "fail" and v.step == 1 and v.param == "gradient norm"
    tables, sid = _clip_tables([0.5, 0.05, 0.3], [0.5, 0.05, 0.3])  # below max_norm 0.1 at step 2: never tested
    verdicts = clip_acts(tables)
    assert [(v.status, v.step) for v in verdicts] == [("fail", 2), ("fail", 2)]
    assert "clipping did not act" in verdicts[1].where
    tables, sid = _clip_tables([0.05, 0.04, 0.03], [0.05, 0.04, 0.03], feature="clip_inf")  # max norm 0.01
    assert [v.status for v in clip_acts(tables)] == ["pass", "pass"]


def test_activation_checkpointing_is_compared_with_the_plain_model_without_it():
    """Recomputation must change no number: an ac run's reference is the plain step's."""
    sc = Scenario("fsdp_impl", "mlp", 2, "split", "adamw", feature="ac")
    assert sc.reference().id == "reference-mlp-ws1-replicated-adamw"
    assert sc.at_world_size(1).id == "fsdp_impl-mlp-ws1-split-adamw-ac"


def test_checkpointed_units_recompute_their_forward_in_backward():
    from harness.train.features import checkpoint_units

    spec = get_model_spec("mlp")
    torch.manual_seed(0)
    model = spec.build()
    units = spec.units(model)
    calls = []
    for u in units:
        u.register_forward_hook(lambda m, a, o: calls.append(m))  # hooks fire once per module call...
        inner = u.forward
        u.forward = lambda *a, inner=inner, u=u, **k: (calls.append(("forward", u)), inner(*a, **k))[1]
    checkpoint_units(units)
    x, y = spec.make_batch(8, 1, 0)
    forward_backward("ac", spec, model, x, y)
    runs = [c for c in calls if isinstance(c, tuple)]
    assert len(runs) == 2 * len(units)  # ...the forward itself runs again in backward
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp2_infinity_norm_on_an_empty_shard_is_the_one_documented_crash():
    """policy.py documents torch's clip_grad_norm_ raising for FSDP2 under clip_inf where a shard is
    empty; the same error from another implementation or feature, or another error, stays a FAIL."""
    from harness.checks.numeric import completed

    error = (
        "rank 3 failed: RuntimeError: _foreach_norm cannot compute the infinity norm on an empty tensor "
        "because the operation does not have an identity"
    )
    rows = []
    for impl, feature, text in (
        ("torch_fsdp2", "clip_inf", error),
        ("fsdp_impl", "clip_inf", error),
        ("torch_fsdp2", "clip", error),
        ("torch_fsdp2", "clip_inf", "RuntimeError: other"),
    ):
        sc = Scenario(impl, "mlp", 8, "replicated", "adamw", feature=feature)
        rows.append(
            dict(
                scenario=sc.id,
                impl=impl,
                model="mlp",
                world_size=8,
                data_mode="replicated",
                optimizer="adamw",
                seed=0,
                feature=feature,
                status="error",
                error=text,
                failed_rank=3,
            )
        )
    statuses = [v.status for v in completed({"scenarios": pd.DataFrame(rows)})]
    assert statuses == ["known", "fail", "fail", "fail"]


def test_the_features_option_reaches_the_matrix_and_refuses_a_bad_name():
    import argparse

    from harness import options

    parser = argparse.ArgumentParser()
    options.add_matrix_arguments(parser.add_argument)
    ns = parser.parse_args(
        [
            "--world-sizes",
            "2",
            "--impl",
            "fsdp_impl",
            "--models",
            "mlp",
            "--data-modes",
            "split",
            "--optimizers",
            "sgd",
            "--features",
            "plain,no_sync",
        ]
    )
    ids = {s.id for s in options.matrix_from(ns).scenarios()}
    assert {
        "fsdp_impl-mlp-ws2-split-sgd",
        "fsdp_impl-mlp-ws2-split-sgd-no_sync",
        "reference-mlp-ws1-replicated-sgd-no_sync",
    } <= ids
    with pytest.raises(argparse.ArgumentTypeError, match="unknown feature 'zero'; choose from plain, accum"):
        options.features("plain,zero")
    assert options.matrix_from(parser.parse_args([])).features == ("plain",)  # the default keeps today's step


def test_an_adapter_may_refuse_a_feature_with_some_optimizers_only():
    """A `refuses` that takes an `optimizer` keyword is asked with the scenario's optimizer (DeepSpeed resumes a
    checkpoint at another world size through a converter that reads Adam's state only); one that does not is asked
    with the feature alone, as before."""
    from harness.adapters import load_adapter
    from harness.adapters.base import missing_capability
    from harness.execute.executor import unsupported

    class ByOptimizer:
        name, sharded = "by_optimizer", True

        def wrap(self, model, units, *, group, device):
            return model

        def full_params(self, wrapped):
            return {}

        def save_checkpoint(self, wrapped, optimizer, path):
            pass

        def load_checkpoint(self, wrapped, optimizer, path):
            pass

        def refuses(self, feature, optimizer=None):
            return "no state to convert" if optimizer == "sgd" else None

    class FeatureOnly(ByOptimizer):
        def refuses(self, feature):
            return None

    assert "no state to convert" in missing_capability(ByOptimizer(), "ckpt", "sgd")
    assert missing_capability(ByOptimizer(), "ckpt", "adamw") is None
    assert missing_capability(FeatureOnly(), "ckpt", "sgd") is None
    ds = load_adapter("deepspeed_zero2")  # its refusals need no DeepSpeed installed
    assert "Adam's state" in missing_capability(ds, "ckpt", "sgd")
    assert missing_capability(ds, "ckpt", "adamw") is None
    resumed = Scenario("deepspeed_zero3", "mlp", 2, "replicated", "sgd", feature="ckpt", resume_from=1)
    assert "Adam's state" in unsupported(resumed)
    assert (
        unsupported(Scenario("deepspeed_zero3", "mlp", 2, "replicated", "adamw", feature="ckpt", resume_from=1)) is None
    )
