"""The regression gate (harness.gate): diffable baseline files, tolerances, compare verdicts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import pytest

from harness.core.environment import machine_kind
from harness.gate.baseline import BaselineError, load_baseline, save_baseline, summarize
from harness.gate.compare import compare, compare_table
from harness.gate.tolerance import DEFAULT_TOLERANCES, FIELDS, Tolerance, parse_gate

from . import synthetic_tables as syn

SPLIT2 = syn.sid(2, "split")
COMMITTED = Path(__file__).resolve().parents[3] / "reports" / "baselines"


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return syn.make_tables(fail=False)


@pytest.fixture
def saved(tables, tmp_path) -> Path:
    return save_baseline(tables, syn.ENV, "cpu", tmp_path)


def _edit(tables: dict, name: str, sid: str, column: str, fn, step: int | None = None) -> dict:
    """A copy of `tables` with one cell (or one step's cell) of one scenario changed by `fn`."""
    out = {k: v.copy() for k, v in tables.items()}
    df = out[name]
    mask = df["scenario"] == sid
    if step is not None:
        mask &= df["step"] == step
    df[column] = df[column].where(~mask, df[column].map(fn))  # upcasts int columns when fn returns floats
    return out


def _fails(verdicts) -> list:
    return [v for v in verdicts if v.status == "fail"]


def test_round_trip_holds_the_synthetic_figures(tables, saved):
    text = saved.read_text()
    kind = machine_kind(syn.ENV)
    assert saved == saved.parent.parent / "cpu" / f"{kind}.json"  # one file per machine kind
    assert '"torch": "2.13.0"' in text and text.count("\n") > 100  # one value a line
    base = load_baseline("cpu", saved.parent.parent, kind=kind)
    assert load_baseline(saved).scenarios == base.scenarios
    assert set(base.scenarios) == set(tables["scenarios"]["scenario"]) and base.env == syn.ENV
    e = base.scenarios[syn.sid(4, "split")]
    assert e["loss"] == [syn.loss_at(s, 4, "split", fail=False) for s in range(1, 6)]
    assert e["peak_mem"] == syn.mem(4, "split")["peak"] and e["state_mem"] == syn.mem(4, "split")["state_total"]
    assert e["comm_bytes"] == sum(b for _, b in syn.comm(4).values())
    assert e["comm_calls"] == sum(c for c, _ in syn.comm(4).values())
    assert e["max_diff_ref"] == max(syn.param_diff(s, 4, "split", p, False) for s in range(1, 6) for p in syn.PARAMS)
    assert e["step_time"] == syn.STEP_TIME * 4
    verdicts = compare(tables, base, env=syn.ENV)
    assert not _fails(verdicts)
    gated = [v for v in verdicts if v.check.startswith("gate:") and v.check[5:] in FIELDS]
    assert len(gated) == len(base.scenarios) * (len(FIELDS) - 1) + 1
    assert [(v.status, v.scenario) for v in verdicts if v.check == "gate:step_time"] == [("skip", "")]  # off


@pytest.mark.parametrize(
    "name, sid, column, fn, step, field, spec_within",
    [
        ("scenarios", SPLIT2, "peak_bytes", lambda b: b * 1.10, None, "peak_mem", "peak_mem:11%"),
        ("steps", SPLIT2, "loss", lambda x: x + 5e-7, 3, "loss", "loss:1e-6"),
        ("comm", SPLIT2, "bytes", lambda b: b + 1, None, "comm_bytes", "comm_bytes:2"),  # 2 collectives, +1 each
        ("scenarios", SPLIT2, "max_diff_ref", lambda x: x * 2, None, "max_diff", "max_diff:100%"),
        ("scenarios", SPLIT2, "step_time_s", lambda x: x * 3, None, "step_time", None),
    ],
)
def test_gate_fails_naming_the_field_and_passes_within(tables, saved, name, sid, column, fn, step, field, spec_within):
    changed = _edit(tables, name, sid, column, fn, step)
    tol = parse_gate(f"{field}:50%") if field == "step_time" else None
    bad = _fails(compare(changed, load_baseline(saved), tol))
    assert [(v.check, v.scenario) for v in bad] == [(f"gate:{field}", sid)]
    msg = bad[0].message
    assert field in msg and sid in msg and str((tol or DEFAULT_TOLERANCES)[field]) in msg
    if field == "loss":
        old = syn.loss_at(step, 2, "split", fail=False)
        assert bad[0].step == step and f"baseline {old:.10g}" in msg and f"current {old + 5e-7:.10g}" in msg
    if field == "peak_mem":
        old = syn.mem(2, "split")["peak"]
        assert f"baseline {old}" in msg and f"current {old * 1.10:.10g}" in msg
    if spec_within:
        assert not _fails(compare(changed, load_baseline(saved), parse_gate(spec_within)))


def test_improvements_pass_one_sided_fields(tables, saved):
    smaller = _edit(tables, "scenarios", SPLIT2, "peak_bytes", lambda b: b // 2)
    assert not _fails(compare(smaller, load_baseline(saved)))
    fewer = _edit(tables, "comm", SPLIT2, "bytes", lambda b: b // 2)  # comm is two-sided: any change is news
    assert [v.check for v in _fails(compare(fewer, load_baseline(saved)))] == ["gate:comm_bytes"]


def test_missing_and_new_scenarios_are_reported(tables, saved):
    gone = syn.sid(4, "replicated")
    subset = {k: v[v["scenario"] != gone] if "scenario" in v else v for k, v in tables.items()}
    verdicts = compare(subset, load_baseline(saved))
    assert not _fails(verdicts)  # a run of part of the matrix is gated on what it ran
    missing = [v for v in verdicts if v.scenario == gone]
    assert [(v.check, v.status) for v in missing] == [("gate:scenario", "skip")] and "not in this run" in missing[
        0
    ].message
    small = save_baseline(subset, syn.ENV, "small", saved.parent.parent)
    new = [v for v in compare(tables, load_baseline(small)) if v.scenario == gone]
    assert [(v.check, v.status) for v in new] == [("gate:scenario", "skip")] and "not in baseline" in new[0].message
    errored = _edit(tables, "scenarios", SPLIT2, "error", lambda _: "RuntimeError: boom")
    bad = _fails(compare(errored, load_baseline(saved)))
    assert [(v.check, v.scenario) for v in bad] == [("gate:scenario", SPLIT2)] and "errored" in bad[0].message
    # gated before, not run now: the implementation lost a capability its feature needs
    lost = _edit(
        _edit(tables, "scenarios", SPLIT2, "status", lambda _: "unsupported"),
        "scenarios",
        SPLIT2,
        "error",
        lambda _: "adapter 'x' has no set_gradient_sync() method",
    )
    [v] = _fails(compare(lost, load_baseline(saved)))
    assert v.scenario == SPLIT2 and "is unsupported in this run" in v.message


def test_one_rank_moves_nothing_and_that_is_measured_not_missing(tables, saved):
    """A run of world size 1 alone has an empty comm table (one rank calls no collective): its
    traffic is 0, measured, and held against the baseline's 0 like any other figure."""
    ws1 = {
        k: v[v["scenario"].isin([syn.sid(1, m) for m in ("replicated", "split")] + [syn.REF_ID])]
        if "scenario" in v
        else v
        for k, v in tables.items()
    }
    assert not len(ws1["comm"])
    current = summarize(ws1)
    assert {(current[s]["comm_bytes"], current[s]["comm_calls"]) for s in current} == {(0, 0)}
    verdicts = compare(ws1, load_baseline(saved))
    assert not _fails(verdicts), [str(v) for v in _fails(verdicts)]
    traffic = [v for v in verdicts if v.check in ("gate:comm_bytes", "gate:comm_calls") and v.scenario]
    assert len(traffic) == 2 * len(current) and {v.status for v in traffic} == {"pass"}
    moved = _edit(tables, "comm", SPLIT2, "bytes", lambda b: b)  # a run that did not finish measured nothing
    broken = summarize(_edit(moved, "scenarios", SPLIT2, "error", lambda _: "RuntimeError: boom"))
    assert broken[SPLIT2]["comm_bytes"] is None and broken[SPLIT2]["status"] == "error"


def test_a_baseline_records_the_configuration_of_its_run(tables, saved):
    doc = json.loads(saved.read_text())
    sc = syn.scenario(2, "split")
    assert doc["configuration"] == {
        "impls": [syn.IMPL],
        "models": [syn.MODEL],
        "world_sizes": [1, 2, 4],
        "data_modes": ["replicated", "split"],
        "optimizers": [syn.OPT],
        "features": ["plain"],
        "seeds": [sc.seed],
        "lr": sc.lr,
        "steps": sc.steps,
        "global_batch": sc.global_batch,
        "backend": syn.ENV["backend"],
    }
    assert load_baseline(saved).configuration == doc["configuration"]


def _configured(tables: dict, column: str, value) -> dict:
    """`tables` as a run whose every scenario had `column` = value."""
    return _edit(tables, "scenarios", SPLIT2, column, lambda _: value) | {
        "scenarios": tables["scenarios"].assign(**{column: value})
    }


def test_another_learning_rate_is_a_configuration_difference_not_a_regression(tables, saved):
    """Scenario ids do not name the learning rate: the same ids trained at another lr moved every
    loss, and a lower loss is no regression. The gate says what differs, compares no loss or diff,
    and still holds memory and traffic, which the lr does not change."""
    lr = syn.scenario(2, "split").lr
    other = _configured(_edit(tables, "steps", SPLIT2, "loss", lambda x: x - 1e-3, 2), "lr", 2 * lr)
    other = _edit(other, "scenarios", SPLIT2, "peak_bytes", lambda b: b * 2)
    verdicts = compare(other, load_baseline(saved), env=syn.ENV)
    assert [(v.check, v.scenario) for v in _fails(verdicts)] == [("gate:peak_mem", SPLIT2)]
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert note.status == "skip" and f"configuration differs: lr {lr:g} -> {2 * lr:g}" in note.message
    for field in ("loss", "max_diff"):
        assert [(v.status, v.scenario) for v in verdicts if v.check == f"gate:{field}"] == [("skip", "")]
    assert {v.scenario for v in verdicts if v.check == "gate:comm_bytes"} == set(summarize(tables))


@pytest.mark.parametrize("column, value", [("steps", 7), ("global_batch", 32)])
def test_other_steps_or_batch_compare_nothing_of_the_same_ids(tables, saved, column, value):
    verdicts = compare(_configured(tables, column, value), load_baseline(saved), env=syn.ENV)
    assert not _fails(verdicts)
    gated = [f for f, (t, _) in FIELDS.items() if not t.off]
    assert all(v.status == "skip" and not v.scenario for v in verdicts), [str(v) for v in verdicts]
    assert sorted(v.check for v in verdicts if v.check[5:] in gated) == sorted(f"gate:{f}" for f in gated)
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert f"configuration differs: {column} " in note.message and f"-> {value}" in note.message


def test_fewer_world_sizes_only_narrow_what_is_compared(tables, saved):
    part = {
        k: v[~v["scenario"].isin([syn.sid(4, "replicated"), syn.sid(4, "split")])] if "scenario" in v else v
        for k, v in tables.items()
    }
    verdicts = compare(part, load_baseline(saved), env=syn.ENV)
    assert not _fails(verdicts)
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert "configuration differs: world_sizes 1,2,4 -> 1,2: only the scenarios both runs have" in note.message
    assert any(v.check == "gate:loss" and v.scenario == SPLIT2 and v.status == "pass" for v in verdicts)


def test_a_baseline_saved_before_configurations_were_recorded_still_gates_and_says_so(tables, saved):
    doc = json.loads(saved.read_text())
    del doc["configuration"]
    old = _write(saved.with_name("old.json"), json.dumps(doc))
    base = load_baseline(old)
    assert base.configuration is None
    moved = _edit(tables, "steps", SPLIT2, "loss", lambda x: x + 1e-6, 2)
    verdicts = compare(moved, base, env=syn.ENV)
    assert [(v.check, v.scenario) for v in _fails(verdicts)] == [("gate:loss", SPLIT2)]
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert note.status == "skip" and "does not record the configuration" in note.message


def test_a_run_that_did_not_record_a_setting_is_told_so(tables, saved):
    verdicts = compare(
        {**tables, "scenarios": tables["scenarios"].drop(columns="global_batch")}, load_baseline(saved), env=syn.ENV
    )
    assert not _fails(verdicts)
    [note] = [v for v in verdicts if v.check == "gate:configuration"]
    assert note.where == "global_batch" and "this run does not record global_batch" in note.message


@pytest.mark.parametrize("path", sorted(COMMITTED.glob("*/*.json")), ids=lambda p: p.stem)
def test_the_committed_baselines_record_the_configuration_their_scenarios_show(path):
    base = load_baseline(path)
    cfg, entries = base.configuration, [e for e in base.scenarios.values() if e["impl"] != "reference"]
    assert cfg is not None, f"{path} records no configuration"
    for field, key in (
        ("impls", "impl"),
        ("models", "model"),
        ("world_sizes", "world_size"),
        ("data_modes", "data_mode"),
        ("optimizers", "optimizer"),
        ("seeds", "seed"),
    ):
        assert cfg[field] == sorted({e[key] for e in entries}), field
    assert {len(e["loss"]) for e in entries} == {cfg["steps"]} and cfg["backend"] == base.env["backend"]


def test_environment_differences_are_visible(tables, saved):
    env = {**syn.ENV, "torch": "2.14.0", "date": "2030-01-01", "git_commit": "fff"}
    warn = [v for v in compare(tables, load_baseline(saved), env=env) if v.check == "gate:env"]
    assert [(v.status, v.where) for v in warn] == [("skip", "torch")]
    assert "2.13.0" in warn[0].message and "2.14.0" in warn[0].message


def test_compare_table_side_by_side(tables, saved):
    changed = _edit(tables, "comm", SPLIT2, "bytes", lambda b: b + 8)
    df = compare_table(changed, load_baseline(saved))
    row = df[(df["scenario"] == SPLIT2) & (df["check"] == "gate:comm_bytes")].iloc[0]
    expected = sum(b for _, b in syn.comm(2).values())
    assert (row["baseline"], row["current"], row["delta"], row["status"]) == (expected, expected + 16, 16, "fail")
    assert (df["status"] == "fail").sum() == 1


@pytest.mark.parametrize(
    "case",
    ["loss moved, other kernels", "loss moved, same kernels", "scenario missing", "new scenario", "comm changed"],
)
def test_compare_and_the_gate_give_the_same_answer(tables, saved, case):
    """`python -m harness compare` and `--baseline` are two views of one comparison: the same
    statuses for the same tables, environment and baseline (they differed on the env rule)."""
    env = dict(syn.ENV)
    cur = tables
    if case.startswith("loss moved"):
        cur = _edit(tables, "steps", SPLIT2, "loss", lambda x: x + 1e-6, 2)
        if "other" in case:
            env["cpu_capability"] = "AVX512"
    elif case == "scenario missing":
        cur = {k: v[v["scenario"] != SPLIT2] if "scenario" in v else v for k, v in tables.items()}
    elif case == "new scenario":
        base_tables = {k: v[v["scenario"] != SPLIT2] if "scenario" in v else v for k, v in tables.items()}
        saved = save_baseline(base_tables, syn.ENV, "fewer", saved.parent.parent)
    else:
        cur = _edit(tables, "comm", SPLIT2, "bytes", lambda b: b + 8)
    base = load_baseline(saved)
    gate = sorted((v.check, v.scenario, v.status) for v in compare(cur, base, env=env))
    table = compare_table(cur, base, env=env)
    assert gate == sorted(zip(table["check"], table["scenario"], table["status"]))
    failed = {(c, s) for c, s, st in gate if st == "fail"}
    expected = {"loss moved, same kernels": {("gate:loss", SPLIT2)}, "comm changed": {("gate:comm_bytes", SPLIT2)}}
    assert failed == expected.get(case, set())


def test_a_kind_without_its_own_file_gates_memory_not_losses(tables, tmp_path):
    """A machine kind with no baseline file takes another kind's: memory and traffic are gated,
    losses are not, and the verdicts say so plainly."""
    avx2 = {**syn.ENV, "cpu_capability": "AVX2"}
    save_baseline(tables, avx2, "default", tmp_path)
    here = {**syn.ENV, "cpu_capability": "AVX512"}
    base = load_baseline("default", tmp_path, kind=machine_kind(here))
    assert base.wanted_kind == machine_kind(here) and base.path.name == f"{machine_kind(avx2)}.json"
    moved = _edit(
        _edit(tables, "steps", SPLIT2, "loss", lambda x: x + 1e-3, 2),
        "scenarios",
        SPLIT2,
        "peak_bytes",
        lambda b: b * 2,
    )
    verdicts = compare(moved, base, env=here)
    assert [(v.check, v.scenario) for v in _fails(verdicts)] == [("gate:peak_mem", SPLIT2)]
    note = [v for v in verdicts if v.check == "gate:loss" and v.scenario == ""]
    assert note and note[0].status == "skip" and "NOT gated" in note[0].message
    assert machine_kind(here) in note[0].message
    save_baseline(tables, here, "default", tmp_path)  # once this kind has its own, losses are gated
    own = load_baseline("default", tmp_path, kind=machine_kind(here))
    assert not own.wanted_kind
    assert ("gate:loss", SPLIT2) in [(v.check, v.scenario) for v in _fails(compare(moved, own, env=here))]


@pytest.mark.parametrize("here", [{"torch": "2.9.1"}, {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}])
def test_only_another_torch_or_device_on_file_gates_nothing_and_says_so(tables, tmp_path, here):
    """A GPU box or another torch keeps its own torch: FSDP2's memory and traffic may differ there,
    so another version's figures are no yardstick. Nothing is gated, and every field says why."""
    save_baseline(tables, {**syn.ENV, "cpu_capability": "AVX2"}, "default", tmp_path)
    env = {**syn.ENV, "cpu_capability": "AVX2", **here}
    base = load_baseline("default", tmp_path, kind=machine_kind(env))
    assert not base.comparable and not base.scenarios
    doubled = _edit(tables, "scenarios", SPLIT2, "peak_bytes", lambda b: b * 2)
    verdicts = compare(doubled, base, env=env)
    gated = [f for f, (t, _) in FIELDS.items() if not t.off]
    fields = [v for v in verdicts if v.check != "gate:coverage"]
    assert sorted(v.check for v in fields) == sorted(f"gate:{f}" for f in gated)
    assert all(v.status == "skip" and v.scenario == "" and "nothing was gated" in v.message for v in fields)
    assert machine_kind(env) in verdicts[0].message
    [nothing] = [v for v in verdicts if v.check == "gate:coverage"]
    assert nothing.status == "skip" and "compared nothing" in nothing.message and machine_kind(env) in nothing.message
    [strict] = [v for v in compare(doubled, base, env=env, strict=True) if v.check == "gate:coverage"]
    assert strict.status == "fail" and "--gate-strict" in strict.message


@pytest.mark.parametrize("case", ["no scenario in common", "every field skipped", "something compared"])
def test_a_gate_that_compared_nothing_says_why_and_strict_fails_it(tables, saved, case):
    """A gate with no figure to compare checked nothing: one run-wide gate:coverage verdict says so
    and why (a skip; a failure with --gate-strict). A gate that compared figures says nothing more."""
    cur = tables
    if case == "no scenario in common":
        cur = {k: v.assign(scenario=v["scenario"] + "-elsewhere") if "scenario" in v else v for k, v in tables.items()}
    elif case == "every field skipped":
        cur = _configured(tables, "steps", 7)
    for strict in (False, True):
        verdicts = compare(cur, load_baseline(saved), env=syn.ENV, strict=strict)
        coverage = [v for v in verdicts if v.check == "gate:coverage"]
        if case == "something compared":
            assert not coverage and not _fails(verdicts)
            continue
        [v] = coverage
        assert v.status == ("fail" if strict else "skip") and v.scenario == ""
        assert "compared nothing" in v.message
        assert ("no scenario of this run is in it" if case == "no scenario in common" else "steps 5 -> 7") in v.message
        assert [str(f) for f in _fails(verdicts)] == ([str(v)] if strict else [])


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d, s: d / "nope.json", "baseline not found"),
        (lambda d, s: _write(s, s.read_text()[:200]), "not valid JSON"),
        (lambda d, s: _write(s, json.dumps({**json.loads(s.read_text()), "version": 2})), "has version 2"),
        (lambda d, s: _write(s, json.dumps({"scenarios": {}})), "not a baseline file"),
        (
            lambda d, s: _write(s, s.read_text().replace('"loss": [', '"loss": ["x", ', 1)),
            "loss is not a list of numbers",
        ),
        (lambda d, s: _write(s, s.read_text().replace('"peak_mem"', '"peak_memory"', 1)), "lacks ['peak_mem']"),
    ],
)
def test_unusable_baselines_raise_one_clear_line(saved, make, message):
    path = make(saved.parent, saved)
    with pytest.raises(BaselineError) as err:
        load_baseline(path)
    assert message in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_baseline_by_name(tmp_path):
    with pytest.raises(BaselineError, match=r"baseline not found: no .*ghost/\*\.json"):
        load_baseline("ghost", tmp_path)


def test_parse_gate_values_and_defaults():
    tols = parse_gate(" loss:1e-6 , peak_mem:5%,comm_bytes:0,step_time:off")
    assert tols["loss"] == Tolerance(1e-6) and tols["peak_mem"] == Tolerance(0.05, relative=True, floor=4096)
    assert tols["comm_bytes"] == Tolerance(0.0) and tols["step_time"].off
    assert tols["state_mem"] == DEFAULT_TOLERANCES["state_mem"] and set(tols) == set(FIELDS)
    assert parse_gate("") == DEFAULT_TOLERANCES and DEFAULT_TOLERANCES["step_time"].off
    assert Tolerance(0.05, relative=True).fails(106, 100, two_sided=False)
    assert not Tolerance(0.05, relative=True).fails(104, 100, two_sided=False)
    assert not Tolerance(0.05, relative=True).fails(50, 100, two_sided=False)
    assert Tolerance(0.5, relative=True).fails(1e-12, 0.0)  # a relative bound on 0 allows nothing


@pytest.mark.parametrize(
    "spec, words",
    [
        ("lossy:1e-7", "unknown gate field 'lossy'"),
        ("loss:abc", "'abc' is not a number"),
        ("loss:-1", "'-1'"),
        ("loss", "must be FIELD:TOLERANCE"),
        ("loss:1,loss:2", "given twice"),
        ("peak_mem:5%%", "'5%%'"),
        ("loss:nan", "'nan'"),
        ("loss:", "must be FIELD:TOLERANCE"),
    ],
)
def test_parse_gate_rejects_bad_specs(spec, words):
    with pytest.raises(ValueError, match="gate") as err:
        parse_gate(spec)
    assert words in str(err.value)


def test_parse_gate_message_reaches_argparse(capsys):
    parser = argparse.ArgumentParser(prog="fsdp-harness")
    parser.add_argument("--gate", type=parse_gate)
    with pytest.raises(SystemExit):
        parser.parse_args(["--gate", "bogus:1"])
    assert "unknown gate field 'bogus'" in capsys.readouterr().err


def test_save_baseline_is_atomic_and_validates_name(tables, saved, monkeypatch):
    before = saved.read_bytes()
    monkeypatch.setattr("harness.gate.baseline.json.dumps", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save_baseline(tables, syn.ENV, "cpu", saved.parent.parent)
    assert saved.read_bytes() == before and [p.name for p in saved.parent.iterdir()] == [saved.name]
    for bad in ("../escape", "..", "a/b"):
        with pytest.raises(ValueError, match="baseline name"):
            save_baseline(tables, syn.ENV, bad, saved.parent.parent)


def test_loss_gate_points_at_the_first_step_that_crossed(tables, saved):
    changed = _edit(
        _edit(tables, "steps", SPLIT2, "loss", lambda x: x + 5e-7, 3), "steps", SPLIT2, "loss", lambda x: x + 5e-6, 4
    )
    bad = _fails(compare(changed, load_baseline(saved)))
    assert [(v.check, v.step) for v in bad] == [("gate:loss", 3)]
    assert bad[0].measured == pytest.approx(5e-7, rel=1e-6) and bad[0].bound == 1e-7


def test_peak_mem_tolerance_has_an_absolute_floor():
    tol = DEFAULT_TOLERANCES["peak_mem"]
    base = 34728  # a small model: 5% is 1736 B, less than one gloo buffer whose release races the step
    assert tol.allowed(base) == 4096 and tol.allowed(10 * 2**20) == 0.05 * 10 * 2**20
    assert not tol.fails(base + 2236, base, two_sided=False)
    assert tol.fails(base + 4097, base, two_sided=False)
    assert parse_gate("peak_mem:5%min4096")["peak_mem"] == tol and str(tol) == "5%min4096"
    # '5%' alone keeps the floor: the --gate example of docs/report.md must not fail a rerun on the gloo race
    assert parse_gate("peak_mem:5%")["peak_mem"] == tol and not parse_gate("peak_mem:5%")["peak_mem"].fails(
        base + 2236, base, two_sided=False
    )
    assert parse_gate("peak_mem:5%min0")["peak_mem"].floor == 0
    for bad in ("loss:1e-7min3", "peak_mem:5%min-1", "peak_mem:5%minx"):
        with pytest.raises(ValueError, match="gate"):
            parse_gate(bad)


def test_other_cpu_kernels_skip_loss_and_diffs_but_gate_the_rest(tables, tmp_path):
    there = {**syn.ENV, "cpu_capability": "AVX512", "cpu": "Intel Xeon (family 6, model 143)"}
    saved = save_baseline(tables, there, "avx512", tmp_path)
    changed = _edit(tables, "steps", SPLIT2, "loss", lambda x: x + 5e-7, 3)
    changed = _edit(changed, "scenarios", SPLIT2, "peak_bytes", lambda b: b * 2)
    for here, named in (
        ({**there, "cpu_capability": "AVX2"}, "AVX2"),
        ({**there, "cpu": "AMD EPYC (family 25, model 1)"}, "AMD EPYC"),
        ({**there, "torch": "2.11.0"}, "2.11.0"),
        ({k: v for k, v in there.items() if k != "cpu"}, "not recorded"),
    ):
        verdicts = compare(changed, load_baseline(saved), env=here)
        assert [(v.check, v.scenario) for v in _fails(verdicts)] == [("gate:peak_mem", SPLIT2)], named
        skipped = [v for v in verdicts if v.check in ("gate:loss", "gate:max_diff")]
        assert [(v.check, v.status, v.scenario) for v in skipped] == [
            ("gate:loss", "skip", ""),
            ("gate:max_diff", "skip", ""),
        ]
        assert named in skipped[0].message
    # the same kernels: losses compared as before, also on another generation of the same named CPU
    for here in (there, {**there, "cpu": "Intel Xeon (family 6, model 207)"}):
        assert ("gate:loss", SPLIT2) in [
            (v.check, v.scenario) for v in _fails(compare(changed, load_baseline(saved), env=here))
        ], here
    # a baseline that recorded no kernel facts cannot prove they match: not compared
    old = save_baseline(tables, syn.ENV, "old", tmp_path)
    assert ("gate:loss", SPLIT2) not in [
        (v.check, v.scenario) for v in _fails(compare(changed, load_baseline(old), env=there))
    ]
