"""The localiser names where each numeric mutant's defect is (suites/mutants/localised.py) and a fault inside a
backward op at that op, and names nothing beyond rounding on correct implementations. A few cells run in every CI
run; the whole catalogue and the correct cells of every feature with --slow (13 to 17 minutes on 2 busy cores)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from harness.core.scenario import Scenario
from harness.localize.replay import replay, scenario_of_id
from suites.mutants.catalog import CATALOGUE
from suites.mutants.localised import NOT_LOCALISED, ROUNDING, WHERE, cell

QUICK = {
    "grad_summed",
    "wrong_shard_offset",
    "stale_shard",
    "clip_local_norm",
    "bf16_optimizer_step",
    "ckpt_last_rank_shifted",
    "last_rank_negated",
}
NUMERIC = [m for m in CATALOGUE if m.kind == "numeric"]


@pytest.fixture(scope="module")
def pool(kept_worlds):
    return kept_worlds


def _localise(sc: Scenario, pool):
    with tempfile.TemporaryDirectory(prefix="fsdp-localize-test-") as d:
        return replay(sc, pool=pool, workdir=Path(d))


def test_every_numeric_mutant_says_where_its_defect_is_or_why_not():
    names = {m.name for m in NUMERIC}
    assert names == set(WHERE) | set(NOT_LOCALISED), names ^ (set(WHERE) | set(NOT_LOCALISED))
    assert not set(WHERE) & set(NOT_LOCALISED)


@pytest.mark.parametrize(
    "m",
    [
        pytest.param(m, id=m.name, marks=[] if m.name in QUICK else [pytest.mark.slow])
        for m in NUMERIC
        if m.name in WHERE
    ],
)
def test_the_localiser_names_the_mutants_phase_and_module(m, pool):
    found = _localise(cell(m), pool)
    assert found.point is not None, "\n".join(found.lines())
    assert (found.point.phase, found.point.module) == WHERE[m.name], "\n".join(found.lines())
    assert found.point.rounding == (m.name in ROUNDING), "\n".join(found.lines())
    if getattr(m, "one_rank", False) and found.point.phase != "gradient reduction":
        assert found.point.ranks == [cell(m).world_size - 1], "\n".join(found.lines())


@pytest.mark.parametrize(
    "m", [pytest.param(m, id=m.name, marks=pytest.mark.slow) for m in NUMERIC if m.name in NOT_LOCALISED]
)
def test_a_mutant_the_localiser_cannot_name_shows_no_divergence(m, pool):
    assert not _localise(cell(m), pool).diverged


def test_a_per_sample_mutant_is_localised_to_the_exchange_and_its_collective(pool):
    """per_sample_norms_allreduced computes each rank's own norms right and all-reduces them position by
    position: the localiser finds them, right, in what every rank sent, and names that all-reduce."""
    from suites.mutants.localised import PER_SAMPLE_WHERE, localise_per_sample

    (m,) = [m for m in CATALOGUE if m.kind == "per_sample"]
    found = localise_per_sample(m, pool)
    where, kind = PER_SAMPLE_WHERE[m.name]
    assert found.where == where and kind in found.collective, found.short()


@pytest.mark.parametrize(
    "variant,mode,where",
    [
        ("fsdp_impl", "split", "nothing"),
        ("allreduce_partial", "split", "computation"),
        ("allreduce_partial", "replicated", "nothing"),
    ],
)
def test_per_sample_norms_are_localised_to_the_right_side_of_the_exchange(pool, variant, mode, where):
    """The product's norms: nothing to localise. Norms summed from parameter-shard partials (the known-bad
    aggregation of harness.per_sample.tasks): with split data no rank ever held its own samples' whole norms,
    so the fault is before the exchange; with replicated data the partial sums add up to the truth."""
    from harness.localize.per_sample import replay
    from harness.per_sample.tasks import truth

    payload = {"model": "mlp", "seed": 0, "batch": 8, "mode": mode}
    found = replay(pool, 2, "harness.per_sample.tasks:norms_task", payload, variant, truth("mlp", 0, 8).norms)
    assert found.where == where, found.short()


def test_a_failing_per_sample_verdict_of_a_run_gets_where_it_diverged_appended(pool):
    """run_per_sample(localise=N) replays a failing fsdp_impl norm check traced and appends the chain to its
    message (here on the correct product, whose replay finds the norms right: it says so)."""
    from harness.core.verdict import FAIL, Verdict
    from harness.per_sample.run import localised
    from harness.per_sample.tasks import truth

    v = Verdict("per_sample_norms", "fsdp_impl-mlp-ws2-split", FAIL, 1.0, 1e-5, message="max relative error 1")
    out = localised(v, pool, 2, {"model": "mlp", "seed": 0, "batch": 8, "mode": "split"}, truth("mlp", 0, 8).norms)
    assert out.message.startswith("max relative error 1. Where it diverged: "), out.message
    assert "every rank's norms match the truth" in out.message, out.message


def test_a_correct_step_compares_its_backward_op_by_op_and_leaves_out_the_parameters_preparation():
    """Traced in process on the plain bf16 policy: the backward's ops of the model (the embedding's, whose only
    differentiable input is its weight, and the linear's) are recorded as backward; the backward of the
    parameters' bf16 copies (the casts back to the fp32 master parameters) is preparation, not compared."""
    from torch import nn

    from harness.adapters.reference import MixedPrecision
    from harness.train.trace import StepTracer

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = nn.Embedding(11, 6), nn.Linear(6, 5)

        def forward(self, ids):
            return self.proj(self.embed(ids))

    torch.manual_seed(0)
    model = Tiny()
    wrapped = MixedPrecision(model, torch.bfloat16)
    tracer = StepTracer(model, [model.embed, model.proj])
    tracer.begin_step(1, wrapped)
    mark = tracer.marking(lambda phase, value=None: None)
    with tracer:
        mark("forward")
        loss = wrapped(torch.tensor([[1, 2, 3, 4]])).float().square().sum()
        mark("backward")
        loss.backward()
    backward = [o for o in tracer.ops if o["phase"] == "backward"]
    ops = {(o["module"], o["op"]) for o in backward}
    assert {("embed", "aten.embedding_dense_backward"), ("proj", "aten.mm")} <= ops, ops
    shapes = [list(p.shape) for p in model.parameters()]
    casts = [o for o in backward if o["dtype"] == "float32" and o["shape"][0] in shapes]
    assert not casts, casts


def test_a_fault_inside_a_backward_op_is_named_at_that_op(pool):
    """The last rank's backward re-gather hands layers.1 its weight one ulp off in one element
    (suites/mutants/backward_probe.py): the first op that differs is that unit's backward mm, on that rank
    alone (the reduction after it would only say that the gradients came out an ulp off)."""
    found = _localise(
        Scenario("suites.mutants.backward_probe:backward_regather_nudged", "mlp", 2, "replicated", "adamw", steps=2),
        pool,
    )
    p = found.point
    assert p is not None and not p.rounding, "\n".join(found.lines())
    assert (p.step, p.phase, p.module, p.ranks) == (1, "backward", "layers.1", [1]), "\n".join(found.lines())
    assert p.op.startswith("aten.mm (call 1 of that op in layers.1)"), "\n".join(found.lines())


@pytest.mark.parametrize(
    "impl,model,ws,mode,feature",
    [  # the two costlier cells: the CI tier's (--ci)
        pytest.param("fsdp_impl", "tinylm_tied", 2, "replicated", "plain", marks=pytest.mark.ci),
        pytest.param("fsdp_impl", "mlp", 4, "split", "accum+clip", marks=pytest.mark.ci),
        ("torch_fsdp2", "mlp", 2, "split", "bf16"),
        ("ddp", "mlp", 2, "replicated", "ac"),
    ],
)
def test_correct_implementations_part_from_the_yardstick_by_rounding_at_most(impl, model, ws, mode, feature, pool):
    found = _localise(Scenario(impl, model, ws, mode, "adamw", steps=3, feature=feature), pool)
    assert not found.diverged, "\n".join(found.lines())
    if found.point is not None:  # the only parting allowed: a reduction's order of summation
        assert found.point.phase == "gradient reduction" and found.point.rounding


def test_a_split_run_at_4_ranks_parts_by_the_order_of_summation_alone(pool):
    """4 ranks' gradients summed by the implementation's reduction, 4 micro-batches summed by autograd in the
    yardstick: another order, named as rounding at the reduction, and every later step still compared (the
    yardstick starts each step from the run's parameters)."""
    found = _localise(Scenario("fsdp_impl", "mlp", 4, "split", "adamw", steps=3), pool)
    assert found.point is not None and found.point.rounding and found.point.phase == "gradient reduction"
    assert found.point.step == 1 and found.steps == [1, 2, 3]


@pytest.mark.slow
def test_fsdp2_at_8_ranks_parts_by_its_fp32_reduction_alone(pool):
    """The worked example of docs/localiser.md: FSDP2 sums 8 equal gradients in fp32 (replicated data), an ulp or two
    off the plain gradient; fsdp_impl sums in fp64 and rounds once."""
    found = _localise(Scenario("torch_fsdp2", "mlp", 8, "replicated", "adamw", steps=2), pool)
    assert found.point is not None and found.point.rounding and found.point.phase == "gradient reduction"
    assert not _localise(Scenario("fsdp_impl", "mlp", 8, "replicated", "adamw", steps=2), pool).diverged


def test_ids_name_the_scenario_they_were_made_from():
    for sc in (
        Scenario("fsdp_impl", "mlp", 4, "split", "adamw", feature="accum+clip", seed=3),
        Scenario("suites.mutants.catalog:grad_summed", "hf:gpt2", 2, "replicated", "sgd"),
        Scenario("torch_fsdp2", "tinylm", 2, "replicated", "adamw", feature="ckpt", resume_from=4),
    ):
        assert scenario_of_id(sc.id, steps=sc.steps) == sc
    with pytest.raises(ValueError, match="not a scenario id"):
        scenario_of_id("fsdp_impl-mlp")
    with pytest.raises(ValueError, match="reference or noise probe"):
        scenario_of_id("reference-mlp-ws1-replicated-adamw-micro4")


@pytest.mark.ci  # a whole session; the mutants' localisations above are the default tier's
def test_a_failing_run_localises_its_first_failing_scenarios_into_the_report(tmp_path):
    """The session localises the first --localize N failing scenarios: the "localised" table, the chain in
    those verdicts' messages, the report's "Where it diverged" section; N = 0 localises none."""
    from harness import options as opt
    from harness.session import Session, SessionOptions

    matrix = opt.MatrixOptions(
        impls=("suites.mutants.catalog:stale_shard",),
        models=("mlp",),
        world_sizes=(1, 2),
        data_modes=("replicated",),
        optimizers=("adamw",),
        steps=3,
    )
    session = Session(SessionOptions(matrix, tmp_path / "v.md", localize=1), say=lambda line: None)
    res = session.run()
    loc = res.tables["localised"]
    assert len(loc) == 1, loc.to_dict("records")
    assert (loc.step.iloc[0], loc.phase.iloc[0], loc.module.iloc[0]) == (2, "forward", "layers.0"), loc.to_dict(
        "records"
    )
    scenario = loc.scenario.iloc[0]
    failing = [v for v in res.verdicts if v.scenario == scenario and not v.passed]
    assert failing and all("Where it diverged: " in v.message for v in failing if v.check != "memory_sharding")
    session.write_outputs()
    report = session.report.read_text()
    assert "## Where it diverged" in report and f"### {scenario}" in report

    quiet = Session(SessionOptions(matrix, None, localize=0), say=lambda line: None).run()
    assert "localised" not in quiet.tables


def _correct_cells() -> list[Scenario]:
    """Every feature (and the CI compositions) in both data modes at 2 and 4 ranks on the mlp and the tied
    tinylm, AdamW, 3 steps, for fsdp_impl, FSDP2 with an exact (fp64) reduction and DDP where they support it."""
    from harness.core.features import FEATURES
    from harness.execute.executor import unsupported

    cells = []
    for impl in ("fsdp_impl", "torch_fsdp2_fp64reduce", "ddp"):
        for feature in FEATURES:
            for model in ("mlp", "tinylm_tied"):
                for ws in (2, 4):
                    for mode in ("replicated", "split"):
                        sc = Scenario(
                            impl,
                            model,
                            ws,
                            mode,
                            "adamw",
                            steps=3,
                            feature=feature,
                            resume_from=(6 - ws if feature == "ckpt" else 0),
                        )
                        if not unsupported(sc):
                            cells.append(sc)
    return cells


@pytest.mark.slow
def test_correct_implementations_show_no_divergence_over_every_feature(pool):
    """Over every feature and both data modes (about 90 cells per implementation), the localiser names no
    divergence beyond a reduction's rounding for fsdp_impl, FSDP2 reducing in fp64, and DDP. The one gap, said
    as such: the localiser maps parameters held whole or as dim-0 rows, so a run that holds tinylm_tied's
    matrices as dim-1 columns (shard1) is named unmappable at its initial parameters, and nothing after them is
    compared (the mlp's widths are odd: its shard1 cells are the plain step, compared in full)."""
    from harness.core.features import has

    cells = _correct_cells()
    diverged, unmapped = [], set()
    for sc in cells:
        found = _localise(sc, pool)
        p = found.point
        if found.diverged and p.phase == "initial parameters" and p.detail.endswith("no mapping"):
            unmapped.add(sc.id)
        elif found.diverged:
            diverged.append("\n".join(found.lines()))
    assert not diverged, "\n\n".join(diverged)
    assert unmapped == {sc.id for sc in cells if has(sc.feature, "shard1") and sc.model == "tinylm_tied"}, unmapped


@pytest.mark.ci  # three localisations at 4 ranks
def test_an_optimizer_defect_is_named_after_the_runs_parted_by_rounding(pool):
    """Split data at 4 ranks parts from the yardstick by the reduction's rounding at step 1. The yardstick's
    optimizer then steps on the run's own gradients from the run's own parameters (StepTracer.force_grads), so a
    wrong update is still named, at the optimizer step (bf16_optimizer_step read 'rounding only' before), while
    the correct fsdp_impl and a user's matrix-wise optimizer (its norm summed in the run's order) show none."""
    import dataclasses

    m = next(m for m in NUMERIC if m.name == "bf16_optimizer_step")
    found = _localise(dataclasses.replace(cell(m), world_size=4, data_mode="split"), pool)
    assert found.diverged and (found.point.step, found.point.phase) == (1, "optimizer step"), "\n".join(found.lines())
    for optimizer in ("adamw", "harness.train.optim:normalised_sgd"):
        found = _localise(Scenario("fsdp_impl", "mlp", 4, "split", optimizer, steps=3), pool)
        assert found.point is not None and not found.diverged, "\n".join(found.lines())
