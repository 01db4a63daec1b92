"""The markdown report, its plots, atomic writes, and the CSV run store (harness.report / store)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from xml.etree import ElementTree

import pandas as pd
import pytest

from harness.report import markdown as report
from harness.report import plots
from harness.report.results import MAX_STEP_ROWS
from harness.tables import store
from harness.tables.store import StoreError, load_tables, save_tables

from . import synthetic_tables as syn

SECTIONS = [
    "# FSDP equivalence verification",
    "**Overall: FAIL**",
    "## Verdict summary",
    "## Failures",
    "## Known deviations",
    "## Results per world size",
    "#### Loss per iteration",
    "#### Max |param diff| vs reference per step",
    "## Memory",
    "## Communication",
    "## Environment",
]


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return syn.make_tables()


@pytest.fixture(scope="module")
def rendered(tables, tmp_path_factory) -> tuple[Path, str]:
    path = report.write_report(tables, syn.ENV, tmp_path_factory.mktemp("rep") / "verify.md")
    return path, path.read_text(encoding="utf-8")


def _section(text: str, head: str) -> str:
    start = text.index(head)
    nxt = text.find("\n## ", start + len(head))
    return text[start : nxt if nxt > 0 else None]


def _row(text: str, first_cell: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {first_cell} "))
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_sections_in_order_with_overall_counts(rendered, tables):
    _, text = rendered
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    n = tables["verdicts"]["status"].value_counts()
    assert f"{n['pass']} passed / {n['fail']} failed / {n['known']} known deviations" in text.splitlines()[2]
    assert f"{len(tables['scenarios'])} scenarios" in text


def test_plots_exist_and_are_linked_relatively(rendered):
    path, text = rendered
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    expected = {
        f"verify_plots/{kind}-{syn.IMPL}-{syn.MODEL}-{mode}-{syn.OPT}.svg"
        for kind in ("loss", "diff", "memory")
        for mode in ("replicated", "split")
    }
    assert set(links) == expected
    for link in links:  # a whole SVG document, its text kept as text elements (not drawn as glyph paths)
        svg = ElementTree.parse(path.parent / link).getroot()
        assert svg.tag == "{http://www.w3.org/2000/svg}svg", link
        assert any("".join(e.itertext()).strip() for e in svg.iter("{http://www.w3.org/2000/svg}text")), link
    assert sorted(p.name for p in (path.parent / "verify_plots").iterdir()) == sorted(Path(x).name for x in expected)


def test_no_plots_draws_none_says_where_each_would_be_and_leaves_no_earlier_plot(tmp_path, monkeypatch):
    """--no-plots: the same report text, each plot's place a note; the plots folder is replaced by an empty one,
    so an earlier run's plots do not stay beside a report they do not belong to."""
    tables = syn.make_tables()
    path = report.write_report(tables, syn.ENV, tmp_path / "verify.md")  # an earlier run, with plots
    assert any((tmp_path / "verify_plots").iterdir())
    drawn = []
    for name in ("plot_loss", "plot_diff", "plot_memory"):
        monkeypatch.setattr(plots, name, lambda *args, **_kw: drawn.append(args[-1]))
    text = report.write_report(tables, syn.ENV, path, plots=False).read_text(encoding="utf-8")
    assert drawn == [] and not re.findall(r"!\[[^\]]*\]\(", text)
    notes = re.findall(r"_Plot (loss|param diff|memory) [^\n]*: not drawn \(--no-plots\)\._", text)
    assert sorted(set(notes)) == ["loss", "memory", "param diff"] and len(notes) == 6  # 3 kinds x 2 data modes
    assert list((tmp_path / "verify_plots").iterdir()) == []
    assert [s for s in SECTIONS if s not in text] == []


def test_failure_listed_first_with_its_location(rendered):
    _, text = rendered
    fail_id, known_id = syn.sid(4, "split"), syn.sid(4, "replicated")
    summary = _section(text, "## Verdict summary")
    body = [ln for ln in summary.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert fail_id in body[0] and "FAIL" in body[0]
    assert known_id in body[1] and "KNOWN" in body[1]
    failures = _section(text, "## Failures")
    crossed = syn.param_diff(syn.FAIL_STEP, 4, "split", syn.FAIL_PARAM)
    assert fail_id in failures
    assert (
        f"step {syn.FAIL_STEP}, `{syn.FAIL_PARAM}`, {crossed:.3g} = {crossed / syn.SPLIT_BOUND:.3g}x the bound"
        in failures
    )
    assert f"{syn.FAIL_STEP} ← first crossing" in failures
    final = syn.param_diff(5, 4, "split", syn.FAIL_PARAM)
    assert f"measured** {final:.3g} against **bound** {syn.SPLIT_BOUND:.3g}" in failures
    known = _section(text, "## Known deviations")
    assert known_id in known and syn.KNOWN_CAUSE in known and fail_id not in known


def test_per_world_size_figures(rendered):
    _, text = rendered
    split = text[text.index(f"### {syn.IMPL} · {syn.MODEL} · split · {syn.OPT}") : text.index("## Memory")]
    row = _row(split, "4")
    m1, m4 = syn.mem(1, "split"), syn.mem(4, "split")
    assert row[1] == format(syn.loss_at(5, 4, "split"), ".10g")
    assert row[5] == f"{m4['state_total'] / 2**20:.2f} MiB"
    assert row[7] == f"{m1['state_total'] / m4['state_total']:.2f}x" == "4.00x"
    assert row[8] == f"{m1['peak'] / m4['peak']:.2f}x"
    loss_row = _row(split, str(syn.FAIL_STEP))
    assert loss_row[1:4] == [format(syn.loss_at(syn.FAIL_STEP, ws, "split"), ".10g") for ws in (1, 2, 4)]
    comm = _section(text, "## Communication")
    calls, nbytes = syn.comm(4)["reduce_scatter_tensor"]
    rs = next(ln for ln in comm.splitlines() if "reduce_scatter_tensor" in ln and ln.split("|")[1].strip() == "4")
    cells = [c.strip() for c in rs.strip().strip("|").split("|")]
    # world size, collective, dtype, group ranks (none recorded here), calls, elements (float32: 4 bytes each),
    # bytes, exact bytes
    assert cells[2:6] == ["float32", "—", str(calls), f"{nbytes // 4:,}"] and cells[-1] == str(nbytes), cells
    assert "No collectives at W=1." in comm
    env = _section(text, "## Environment")
    assert all(str(v) in env for v in syn.ENV.values())


def test_memory_ideal_columns_when_present(tmp_path, fast_plots):
    text = report.write_report(syn.make_tables(modes=("split",), ideal_memory=True), {}, tmp_path / "r.md").read_text()
    mem = _section(text, "## Memory")
    assert "measured (ideal)" in mem
    quarter = syn.mem(4, "split")["params"] / 1024
    assert _row(mem, "params")[3] == f"{quarter:.2f} KiB ({quarter:.2f} KiB)"
    assert "_Environment: not recorded._" in text


def test_missing_tables_render_not_measured(tmp_path, fast_plots):
    text = report.write_report({}, {}, tmp_path / "empty.md").read_text()
    for what in ("Verdicts", "Scenario results", "Memory", "Communication"):
        assert f"_{what}: not measured._" in text
    partial = {k: v for k, v in syn.make_tables(modes=("split",)).items() if k in ("steps", "verdicts")}
    partial["memory"] = pd.DataFrame()
    text = report.write_report(partial, syn.ENV, tmp_path / "partial.md").read_text()
    assert "_Memory: not measured._" in text and "_Communication: not measured._" in text
    assert "#### Loss per iteration" in text


def test_long_runs_sample_steps_and_pipes_are_escaped(tmp_path, fast_plots):
    tables = syn.make_tables(world_sizes=(1, 2), modes=("split",), steps=40, fail=False)
    v = tables["verdicts"]
    tables["verdicts"] = pd.concat(
        [
            v,
            pd.DataFrame(
                [dict(check="odd|name", scenario="", status="pass", measured=1.0, bound=2.0, where="|w|", message="")]
            ),
        ]
    )
    text = report.write_report(tables, {}, tmp_path / "long.md").read_text()
    loss = text[text.index("#### Loss per iteration") : text.index("#### Max |param diff|")]
    rows = [ln for ln in loss.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) <= MAX_STEP_ROWS and rows[0].startswith("| 1 ") and rows[-1].startswith("| 40 ")
    assert len(_row(text, "odd\\|name")) == 6


def test_diff_plot_draws_exact_zeros_on_a_labelled_floor():
    steps = syn.make_tables(world_sizes=(1, 4), modes=("split",))["steps"]
    steps = steps[steps["impl"] == syn.IMPL]
    smallest = min(max(syn.param_diff(1, 4, "split", p) for p in syn.PARAMS), syn.SPLIT_BOUND)
    floor = 10.0 ** (math.floor(math.log10(smallest)) - 2)
    ax = plots.diff_figure(steps, "t", bounds={"split_tolerance": syn.SPLIT_BOUND}).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert ax.get_yscale() == "log"
    assert list(lines["W=1"].get_ydata()) == pytest.approx([floor] * 5, rel=1e-12)
    assert lines["W=4"].get_ydata()[syn.FAIL_STEP - 1] == syn.param_diff(syn.FAIL_STEP, 4, "split", syn.FAIL_PARAM)
    assert ax.yaxis.get_major_formatter()(floor, 0) == "0 (exact)"
    assert ax.yaxis.get_major_formatter()(floor * 10, 0) != "0 (exact)"
    bound = next(ln for label, ln in lines.items() if label.startswith("bound split_tolerance"))
    assert set(bound.get_ydata()) == {syn.SPLIT_BOUND}


def test_memory_plot_has_measured_lines_and_ideal_one_over_w():
    per_ws = pd.DataFrame(
        {
            "world_size": [1, 2, 4],
            "state_bytes": [syn.mem(w, "split")["state_total"] for w in (1, 2, 4)],
            "peak_bytes": [syn.mem(w, "split")["peak"] for w in (1, 2, 4)],
        }
    )
    ax = plots.memory_figure(per_ws, "t").axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    state = lines["state (params+grads+optimizer), measured"]
    assert list(state.get_ydata()) == [syn.mem(w, "split")["state_total"] / 2**20 for w in (1, 2, 4)]
    ideal = lines["ideal state: 1/W"]
    x, y = ideal.get_xdata(), ideal.get_ydata()
    assert y == pytest.approx(syn.mem(1, "split")["state_total"] / 2**20 / x, rel=1e-12)
    assert x.min() == 1 and x.max() == 4 and ax.get_xscale() == "log"


def _snapshot(path: Path) -> dict[str, bytes]:
    plots = path.parent / f"{path.stem}_plots"
    return {"md": path.read_bytes(), **{p.name: p.read_bytes() for p in plots.iterdir()}}


def test_interrupted_plotting_keeps_earlier_report(tmp_path, fast_plots, monkeypatch):
    small = syn.make_tables(world_sizes=(1, 2), modes=("split",), fail=False)
    path = report.write_report(small, {}, tmp_path / "r.md")
    before = _snapshot(path)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "plot_memory", interrupted)
    with pytest.raises(KeyboardInterrupt):
        report.write_report(syn.make_tables(), syn.ENV, path, title="second run")
    assert _snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md", "r_plots"]


def test_failed_publish_restores_earlier_report(tmp_path, fast_plots, monkeypatch):
    small = syn.make_tables(world_sizes=(1, 2), modes=("split",), fail=False)
    path = report.write_report(small, {}, tmp_path / "r.md")
    before = _snapshot(path)
    real = store.os.replace

    def replace(src, dst):  # the markdown move fails after the plots folder was swapped in
        if Path(dst) == path:
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(store.os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        report.write_report(small, {}, path, title="second run")
    monkeypatch.undo()
    assert _snapshot(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.md", "r_plots"]


def test_store_round_trip_is_exact_and_rerenders(tables, tmp_path, fast_plots):
    save_tables(tables, syn.ENV, tmp_path / "run")
    loaded, env = load_tables(tmp_path / "run")
    assert env == syn.ENV and set(loaded) == set(tables)
    for name, df in tables.items():
        pd.testing.assert_frame_equal(loaded[name].reset_index(drop=True), df.reset_index(drop=True), check_dtype=False)
        assert [store._kind(t) for t in loaded[name].dtypes] == [store._kind(t) for t in df.dtypes]
    first = report.write_report(tables, syn.ENV, tmp_path / "verify.md").read_text()
    assert report.write_report(loaded, env, tmp_path / "verify.md").read_text() == first
    save_tables({"steps": tables["steps"].head(3), "memory": pd.DataFrame()}, {}, tmp_path / "run")
    loaded, _ = load_tables(tmp_path / "run")
    assert len(loaded["steps"]) == 3 and loaded["memory"].empty and "params" not in loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "verify.md", "verify_plots"]


def _manifest_edit(directory: Path, **changes) -> None:
    path = directory / store.MANIFEST
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: None, "no saved run"),
        (lambda d: (d / store.MANIFEST).unlink(), "holds no run.json"),
        (lambda d: (d / store.MANIFEST).write_text("{not json"), "not valid JSON"),
        (lambda d: _manifest_edit(d, schema_version=99), "schema version 99"),
        (lambda d: (d / "steps.csv").unlink(), "steps.csv is missing"),
        (lambda d: (d / "steps.csv").write_text("scenario,step\nx,1\n"), "has columns"),
        (lambda d: (d / "comm.csv").write_text((d / "comm.csv").read_text().replace(",4,", ",four,", 1)), "bad values"),
    ],
)
def test_store_errors_are_clear(tmp_path, damage, message):
    directory = tmp_path / "run"
    if message != "no saved run":
        save_tables(syn.make_tables(world_sizes=(2,), modes=("split",)), {}, directory)
    damage(directory)
    with pytest.raises(StoreError, match=message) as err:
        load_tables(directory)
    assert "\n" not in str(err.value)


def test_store_rejects_tables_missing_schema_columns(tmp_path):
    with pytest.raises(StoreError, match="lacks schema columns"):
        save_tables({"steps": pd.DataFrame({"scenario": ["a"], "step": [1]})}, {}, tmp_path / "run")
    assert not any(tmp_path.iterdir())


def test_a_broken_plot_becomes_a_note(tmp_path, fast_plots, monkeypatch):
    def broken(*_a, **_k):
        raise ValueError("no finite data")

    monkeypatch.setattr(plots, "plot_diff", broken)
    text = report.write_report(syn.make_tables(modes=("split",)), {}, tmp_path / "r.md").read_text()
    assert "failed (ValueError: no finite data)" in text and "#### Loss per iteration" in text


def test_failure_of_another_quantity_is_traced_at_its_where_without_a_crossing_claim(tmp_path, fast_plots):
    tables = syn.make_tables(world_sizes=(1, 4), modes=("split",))
    gate = dict(
        check="gate:loss",
        scenario=syn.sid(4, "split"),
        status="fail",
        measured=5e-7,
        bound=1e-7,
        step=2,
        message="loss regressed at step 2",
    )
    tables["verdicts"] = pd.concat([tables["verdicts"], pd.DataFrame([gate])], ignore_index=True)
    text = report.write_report(tables, {}, tmp_path / "r.md").read_text()
    gate_part = text[text.index("### FAIL `gate:loss`") :]
    gate_part = gate_part[: gate_part.index("\n### ") if "\n### " in gate_part else None]
    assert "| 2 ← where" in gate_part and "first crossing" not in gate_part and "x bound" not in gate_part
    assert f"{syn.FAIL_STEP} ← first crossing" in text  # the param-diff failure still gets its crossing


def test_verdict_objects_and_gate_warnings_render(tmp_path, fast_plots):
    from harness.core.verdict import Verdict

    tables = syn.make_tables(world_sizes=(1, 2), modes=("split",), fail=False)
    env_warning = Verdict("gate:env", "", "skip", None, None, "torch", "environment differs: torch was '2.12.0'")
    tables["verdicts"] = [Verdict(**r) for r in tables["verdicts"].to_dict("records")] + [env_warning]
    text = report.write_report(tables, {}, tmp_path / "r.md").read_text()
    assert "**Overall: PASS**" in text
    skipped = text[text.index("Skipped checks:") : text.index("## Results per world size")]
    assert "`gate:env`" in skipped and "torch was '2.12.0'" in skipped


def test_many_passes_collapse_per_check_but_failures_stay_listed(tmp_path, fast_plots):
    tables = syn.make_tables(world_sizes=(1, 4), modes=("split",))
    many = [
        dict(check="gate:loss", scenario=f"s{i}", status="pass", measured=i * 1e-9, bound=1e-7, where="", message="")
        for i in range(45)
    ]
    tables["verdicts"] = pd.concat([tables["verdicts"], pd.DataFrame(many)], ignore_index=True)
    summary = _section(report.write_report(tables, {}, tmp_path / "r.md").read_text(), "## Verdict summary")
    assert _row(summary, "gate:loss")[1:5] == ["45 scenarios", "PASS", f"{44e-9:.3g}", "1e-07"]
    assert _row(summary, "split_matches_full_batch")[1:3] == [syn.sid(4, "split"), "FAIL"]


def test_diff_plot_bounds_come_from_equivalence_checks_only(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(plots, "plot_diff", lambda *a, bounds=None, **k: seen.append(bounds))
    monkeypatch.setattr(plots, "plot_loss", lambda *a, **k: None)
    monkeypatch.setattr(plots, "plot_memory", lambda *a, **k: None)
    tables = syn.make_tables(world_sizes=(1, 4), modes=("split",))
    others = [
        dict(check=c, scenario=syn.sid(4, "split"), status="pass", measured=0.0, bound=b, where="", message="")
        for c, b in (
            ("gate:peak_mem", 5e4),
            ("grad_norm_matches", 1e-6),
            ("peak_memory_bound", 3e5),
            ("memory_sharding", 1.04),
        )
    ]
    tables["verdicts"] = pd.concat([tables["verdicts"], pd.DataFrame(others)], ignore_index=True)
    report.write_report(tables, {}, tmp_path / "r.md")
    # the diff plot draws only bounds on |param diff| vs the reference: not grad norm, memory or the gate
    assert seen == [{"split_matches_full_batch": syn.SPLIT_BOUND}]


def test_rank_balance_from_state_categories_when_no_state_total(tmp_path, fast_plots):
    tables = syn.make_tables(world_sizes=(1, 2), modes=("split",), fail=False)
    mem = tables["memory"]
    mem = mem[mem["category"].isin(["params", "grads", "optimizer_state", "peak"])].copy()
    mem["category"] = mem["category"].where(mem["category"] == "peak", "state_" + mem["category"])
    uneven = (mem["scenario"] == syn.sid(2, "split")) & (mem["rank"] == 1) & (mem["category"] == "state_params")
    mem.loc[uneven, "bytes"] += 4096  # rank 1 holds 4 KiB more (padding, say)
    tables["memory"] = mem
    text = report.write_report(tables, {}, tmp_path / "r.md").read_text()
    state2 = syn.mem(2, "split")["state_total"]
    assert _row(_section(text, "## Memory"), "rank balance (state max/min)")[1:] == [
        "1.00",
        f"{(state2 + 4096) / state2:.2f}",
    ]


def test_the_docs_table_of_tables_is_the_schema():
    """docs/report.md's table of tables is made from harness/tables/schema.py; a column added in one place
    and not the other fails here."""
    from harness.tables import schema

    page = (Path(__file__).resolve().parents[3] / "docs" / "report.md").read_text(encoding="utf-8")
    assert schema.docs_table() in page


def test_built_and_stored_tables_follow_the_schema(tmp_path):
    """build_tables gives every schema column in order; store refuses a table missing a required one."""
    from harness.tables import schema
    from harness.tables.build import build_tables

    built = build_tables([], {})
    assert {name: list(df.columns) for name, df in built.items()} == {name: schema.columns(name) for name in built}
    tables = syn.make_tables(world_sizes=(1,), modes=("replicated",))
    tables["steps"] = tables["steps"].drop(columns=["loss"])
    with pytest.raises(StoreError, match="loss"):
        save_tables(tables, {}, tmp_path / "run")


def test_memory_section_shows_units_gathered_per_phase(tmp_path, fast_plots):
    """The timeline table: the most units gathered at one moment of each phase, by world size."""
    tables = syn.make_tables(modes=("split",))
    g = tables["gathered"]
    g.loc[(g.phase == "after_forward") & g.scenario.str.contains("ws4"), ["units", "root"]] = (3, True)
    mem = _section(report.write_report(tables, {}, tmp_path / "r.md").read_text(), "## Memory")
    assert "Units holding their full parameters at once" in mem
    assert _row(mem, "forward")[1:] == ["1 + root", "1 + root"]  # W=2, W=4 (W=1 holds everything: not shown)
    assert _row(mem, "after forward")[1:] == ["0", "3 + root"]
    assert _row(mem, "backward")[1:] == ["2 + root", "2 + root"]
