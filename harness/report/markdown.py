"""Markdown verification report (plus PNG plots) rendered from a run's tables, written atomically.

Section order: title + overall line, verdict summary, failures (with divergence location), known
deviations, skipped checks, results per world size (with loss / diff-vs-step tables and plots),
memory, communication, per-sample gradient norms (only when the run has them; harness/per_sample/section.py),
environment. Missing or empty tables render as "not measured".
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from harness.core.scenario import REFERENCE_IMPL
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, Verdict
from harness.per_sample.section import per_sample_section
from harness.report import plots
from harness.tables.store import rank_bytes, swap_into_place, writing

GROUP = ["impl", "model", "data_mode", "optimizer", "seed"]
STATUS_ORDER = {FAIL: 0, KNOWN: 1, PASS: 2, SKIP: 3}
MEM_ORDER = ["params", "grads", "optimizer_state", "state_params", "state_grads", "state_optimizer_state",
             "state_total", "activations", "other", "peak"]
ENV_ORDER = ["torch", "backend", "device", "seed", "git_commit", "date", "command"]
MAX_STEP_ROWS = 25
MAX_SUMMARY_ROWS = 40


def _t(tables: dict, name: str) -> pd.DataFrame:
    df = tables.get(name) if tables else None
    if name == "verdicts" and isinstance(df, (list, tuple)):  # a list of Verdict is accepted too
        df = pd.DataFrame([v.as_dict() for v in df], columns=list(Verdict.__dataclass_fields__))
    return df if isinstance(df, pd.DataFrame) else pd.DataFrame()


def _missing(v) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and np.isnan(v)) or v is pd.NA


def num(v, spec: str = ".3g") -> str:
    """A figure for a table cell: '—' when absent, '0' when exactly zero."""
    return "—" if _missing(v) else ("0" if v == 0 else format(float(v), spec))


def human_bytes(v) -> str:
    if _missing(v):
        return "—"
    v = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024


def ratio(a, b, spec: str = ".2f") -> str:
    return "—" if _missing(a) or _missing(b) or not b else f"{format(float(a) / float(b), spec)}x"


def md_table(df: pd.DataFrame) -> str:
    """GitHub-flavoured table with pipes escaped and numbers left exactly as formatted."""
    cells = df.astype(object).map(lambda v: "—" if _missing(v) else str(v).replace("|", "\\|").replace("\n", " "))
    return cells.to_markdown(index=False, disable_numparse=True)


def _label(key: tuple) -> str:
    impl, model, mode, opt, seed = key
    return f"{impl} · {model} · {mode} · {opt}" + (f" · seed {seed}" if seed else "")


def _slug(key: tuple) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(str(k) for k in key[:-1] + ((key[-1],) if key[-1] else ())))


def _pick_steps(steps: list, limit: int = MAX_STEP_ROWS) -> list:
    if len(steps) <= limit:
        return steps
    middle = np.linspace(10, len(steps) - 6, limit - 15).astype(int)
    idx = sorted({*range(10), *range(len(steps) - 5, len(steps)), *middle})
    return [steps[i] for i in idx]


def _cells(tables: dict) -> pd.DataFrame:
    """One row per scenario (the scenarios table, else scenario columns of the steps table)."""
    scen, steps = _t(tables, "scenarios"), _t(tables, "steps")
    if len(scen):
        return scen
    cols = ["scenario", "impl", "model", "world_size", "data_mode", "optimizer", "seed"]
    return steps.drop_duplicates("scenario")[cols] if len(steps) else pd.DataFrame(columns=cols)


def _groups(cells: pd.DataFrame):
    """(key, rows sorted by world size) for every non-reference (impl, model, mode, optimizer, seed)."""
    if not len(cells):
        return []
    real = cells[cells["impl"] != REFERENCE_IMPL]
    return [(k, g.sort_values("world_size")) for k, g in real.groupby(GROUP, sort=False, dropna=False)]


def _reference_id(cells: pd.DataFrame, key: tuple) -> str | None:
    ref = cells[(cells["impl"] == REFERENCE_IMPL) & (cells["model"] == key[1]) & (cells["optimizer"] == key[3])
                & (cells["seed"] == key[4])]
    return ref["scenario"].iloc[0] if len(ref) else None


def _overall(verdicts: pd.DataFrame, cells: pd.DataFrame) -> str:
    n = {s: int((verdicts["status"] == s).sum()) if len(verdicts) else 0 for s in STATUS_ORDER}
    errored = int((cells["error"].fillna("").astype(str) != "").sum()) if "error" in cells else 0
    word = "FAIL" if n[FAIL] or errored else ("PASS" if len(verdicts) else "NO VERDICTS")
    extra = f"; {errored} scenario(s) errored" if errored else ""
    return (f"**Overall: {word}** — {n[PASS]} passed / {n[FAIL]} failed / {n[KNOWN]} known deviations "
            f"({n[SKIP]} skipped; {len(cells)} scenarios{extra})")


# the per-step |param diff| column each numeric check holds against its bound
DIFF_COLUMN = {"ws1_exact": "max_diff_ref", "cross_ws_replicated": "max_diff_ws1",
               "split_matches_full_batch": "max_diff_ref"}


def _int_or_none(x) -> int | None:
    return None if _missing(x) else int(x)


def _text(x) -> str:
    return "" if _missing(x) else str(x)


def location(v: pd.Series) -> str:
    """A verdicts-table row's place, as `Verdict.location` reads it."""
    return Verdict(v["check"], v["scenario"], v["status"], None, None, where=_text(v.get("where")),
                   step=_int_or_none(v.get("step")), param=_text(v.get("param")),
                   rank=_int_or_none(v.get("rank")), sample=_int_or_none(v.get("sample"))).location


def _locate(steps: pd.DataFrame, v: pd.Series) -> tuple[str, int, bool] | None:
    """(diff column, step, crossed) to anchor a failure trace at the step the verdict names; crossed
    when that step is where the check's own |param diff| column crossed its bound."""
    step = _int_or_none(v.get("step"))
    if not len(steps) or step is None or step not in set(steps["step"]):
        return None
    col = DIFF_COLUMN.get(v["check"])
    return (col, step, True) if col else ("max_diff_ref", step, False)


def _failure(v: pd.Series, tables: dict) -> list[str]:
    out = [f"### FAIL `{v['check']}` — `{v['scenario'] or 'run-wide'}`", ""]
    times = ratio(v["measured"], v["bound"], ".3g")
    out.append(f"- **measured** {num(v['measured'])} against **bound** {num(v['bound'])}"
               + (f" ({times} the bound, over by {num(float(v['measured']) - float(v['bound']))})"
                  if times != "—" else ""))
    out += [f"- **where** (from the check): {location(v)}"] if location(v) else []
    out += [f"- {v['message']}"] if v["message"] else []
    steps = _t(tables, "steps")
    steps = steps[steps["scenario"] == v["scenario"]].sort_values("step") if len(steps) else steps
    scen = _t(tables, "scenarios")
    err = scen.loc[scen["scenario"] == v["scenario"], "error"] if len(scen) and "error" in scen else []
    if len(err) and str(err.iloc[0]) not in ("", "nan"):
        out.append(f"- **scenario error**: {err.iloc[0]}")
    anchor = _locate(steps, v)
    if anchor is None:
        return out + ["", "_No per-step trace: the check names no step and its figure is not a per-step "
                          "|param diff|._", ""]
    col, first, crossed = anchor
    row = steps[steps["step"] == first].iloc[0]
    if crossed:
        what = "the reference" if col == "max_diff_ref" else "1 rank"
        param = row["worst_param_ref" if col == "max_diff_ref" else "worst_param_ws1"]
        out.append(f"- **first crossing** (steps table, |param diff| vs {what}): step {first}, "
                   f"`{param}`, {num(row[col])} = {ratio(row[col], v['bound'], '.3g')} the bound")
    mark = "first crossing" if crossed else "where"
    window = steps[(steps["step"] >= first - 2) & (steps["step"] <= first + 2)]
    trace = pd.DataFrame({"step": [f"{s} ← {mark}" if s == first else str(s) for s in window["step"]],
                          "loss": [num(x, ".10g") for x in window["loss"]],
                          "max diff vs reference": [num(x) for x in window["max_diff_ref"]],
                          "worst param (ref)": window["worst_param_ref"].to_list(),
                          "max diff vs 1 rank": [num(x) for x in window["max_diff_ws1"]],
                          "worst param (1 rank)": window["worst_param_ws1"].to_list()})
    out += ["", md_table(trace), ""]
    params = _t(tables, "params")
    p = params[(params["scenario"] == v["scenario"]) & (params["step"] == first)] if len(params) else params
    if len(p):
        key = "diff_ref" if col == "max_diff_ref" else "diff_ws1"
        p = p.sort_values(key, ascending=False).head(5)
        table = pd.DataFrame({"param": p["param"], "numel": p["numel"],
                              "diff vs reference": [num(x) for x in p["diff_ref"]],
                              "diff vs 1 rank": [num(x) for x in p["diff_ws1"]]})
        if crossed:
            table["x bound"] = [ratio(x, v["bound"], ".3g") for x in p[key]]
        out += [f"Parameters at step {first}, largest |diff| first:", "", md_table(table), ""]
    return out


def _on(v: pd.Series) -> str:
    return f"on `{v['scenario']}`" if v["scenario"] else "(run-wide)"


def _closest_pass(check: str, g: pd.DataFrame) -> dict:
    """One row for the passes of a check: measured and bound of the same verdict, the one nearest
    its bound (largest measured / bound; the largest measured where no bound is positive)."""
    share = g["measured"] / g["bound"].where(g["bound"] > 0)
    if share.notna().any():  # a check that passes above its bound (a negative control): the smallest
        pick = share.idxmin() if (share.dropna() > 1).all() else share.idxmax()
    else:
        pick = g["measured"].idxmax() if g["measured"].notna().any() else None
    n = len(g)
    row = {"check": check, "scenario": f"{n} scenario" + "s" * (n != 1), "status": PASS, "measured": None,
           "bound": None, "where": "", "_o": 2}
    if pick is not None:
        row.update(measured=g.at[pick, "measured"], bound=g.at[pick, "bound"],
                   where=f"closest: {g.at[pick, 'scenario']}" if g.at[pick, "scenario"] else "")
    return row


KIND_ORDER = ("correctness", "efficiency", "regression gate")


def check_kind(check: str) -> str:
    """'correctness', 'efficiency' (memory, traffic) or 'regression gate', for a check name."""
    if str(check).startswith("gate:"):
        return "regression gate"
    from harness.checks.numeric import all_checks
    return {c.name: c.kind for c in all_checks()}.get(check, "correctness")


def _verdict_sections(tables: dict) -> list[str]:
    verdicts = _t(tables, "verdicts")
    out = ["## Verdict summary", ""]
    if not len(verdicts):
        return out + ["_Verdicts: not measured._", ""]
    verdicts = verdicts.assign(_o=verdicts["status"].map(STATUS_ORDER).fillna(9),
                               measured=pd.to_numeric(verdicts["measured"], errors="coerce"),
                               bound=pd.to_numeric(verdicts["bound"], errors="coerce"))
    verdicts = verdicts.assign(kind=verdicts["check"].map(check_kind))
    verdicts = verdicts.sort_values(["_o", "check"], kind="stable")
    rows = verdicts
    if len(verdicts) > MAX_SUMMARY_ROWS:  # passes of one check collapse into one row
        passed = pd.DataFrame([_closest_pass(check, g) for check, g in
                               verdicts[verdicts["status"] == PASS].groupby("check", sort=True)])
        passed = passed.assign(kind=passed["check"].map(check_kind))
        rows = pd.concat([verdicts[verdicts["status"] != PASS], passed]).sort_values(["_o", "check"], kind="stable")
        out += [f"Passing verdicts are grouped per check ({len(verdicts)} verdicts in all; the run's "
                "verdicts table lists each). A grouped row shows the pass closest to its bound.", ""]
    out += ["Correctness checks hold that sharded training computes what the plain model computes; "
            "efficiency checks hold memory and traffic to the ZeRO-3 ideal; the gate compares with a baseline.", ""]
    for kind in KIND_ORDER:
        part = rows[rows["kind"] == kind]
        if not len(part):
            continue
        summary = pd.DataFrame({"check": part["check"], "scenario": part["scenario"],
                                "status": part["status"].str.upper(), "measured": [num(x) for x in part["measured"]],
                                "bound": [num(x) for x in part["bound"]],
                                "where": [location(v) for _, v in part.iterrows()]})
        out += [f"### {kind.capitalize()}", "", md_table(summary), ""]
    fails = verdicts[verdicts["status"] == FAIL].fillna({"where": "", "message": ""})
    out += ["## Failures", ""] + ([] if len(fails) else ["None.", ""])
    for _, v in fails.iterrows():
        out += _failure(v, tables)
    out += ["## Known deviations", ""]
    known = verdicts[verdicts["status"] == KNOWN].fillna({"where": "", "message": ""})
    out += [f"- `{v['check']}` {_on(v)}: measured {num(v['measured'])} vs bound {num(v['bound'])}"
            f" ({ratio(v['measured'], v['bound'], '.3g')})" + (f" at {location(v)}" if location(v) else "")
            + f". **Cause:** {v['message'] or 'not stated'}" for _, v in known.iterrows()] or ["None."]
    skips = verdicts[verdicts["status"] == SKIP].fillna({"message": ""})
    if len(skips):
        out += ["", "Skipped checks:", ""] + [f"- `{v['check']}` {_on(v)}: {v['message']}"
                                            for _, v in skips.iterrows()]
    return out + [""]


def _per_ws(rows: pd.DataFrame, mem: pd.DataFrame) -> pd.DataFrame:
    """world size -> state/peak bytes per rank (scenarios table, else the memory table's max over ranks)."""
    d = rows[["scenario", "world_size"]].copy()
    for col, cat in (("state_bytes", "state_total"), ("peak_bytes", "peak")):
        vals = rows[col] if col in rows else pd.Series(np.nan, index=rows.index)
        if len(mem) and vals.isna().any():
            m = rank_bytes(mem, cat)
            vals = vals.fillna(rows["scenario"].map(m.groupby(level="scenario").max() if len(m) else {}))
        d[col] = vals.astype(float)
    return d


def _plot(fn, path: Path, rel: str, alt: str, *args, **kwargs) -> str:
    """Render one plot; a plotting error becomes a note instead of losing the whole report."""
    try:
        fn(*args, path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - a broken plot must not lose the report
        return f"_Plot {alt}: failed ({type(exc).__name__}: {exc})._"
    return f"![{alt}]({rel}/{path.name})"


def _group_sections(tables: dict, plots_dir: Path, rel: str) -> list[str]:
    cells, steps, mem = _cells(tables), _t(tables, "steps"), _t(tables, "memory")
    verdicts = _t(tables, "verdicts")
    out = ["## Results per world size", ""]
    groups = _groups(cells)
    if not groups:
        return out + ["_Scenario results: not measured._", ""]
    for key, rows in groups:
        slug, label = _slug(key), _label(key)
        ref_id = _reference_id(cells, key)
        out += [f"### {label}", "", f"Reference: `{ref_id or 'not run'}`.", ""]
        mws = _per_ws(rows, mem)
        one = mws[mws["world_size"] == 1]
        s1, p1 = (one["state_bytes"].iloc[0], one["peak_bytes"].iloc[0]) if len(one) else (np.nan, np.nan)
        col = lambda c: rows[c] if c in rows else pd.Series(np.nan, index=rows.index)  # noqa: E731
        table = pd.DataFrame({
            "world size": rows["world_size"].astype(int), "final loss": [num(x, ".10g") for x in col("final_loss")],
            "param sum": [num(x, ".10g") for x in col("param_sum")],
            "max diff vs 1 rank": [num(x) for x in col("max_diff_ws1")],
            "max diff vs reference": [num(x) for x in col("max_diff_ref")],
            "per-rank state": [human_bytes(x) for x in mws["state_bytes"]],
            "peak memory": [human_bytes(x) for x in mws["peak_bytes"]],
            "reduction vs 1 rank": [ratio(s1, x) for x in mws["state_bytes"]],
            "peak reduction": [ratio(p1, x) for x in mws["peak_bytes"]],
            "step time": [num(x, ".3f") + " s" if not _missing(x) else "—" for x in col("step_time_s")]})
        if "error" in rows and (rows["error"].fillna("").astype(str) != "").any():
            table["error"] = rows["error"].fillna("").astype(str).to_list()
        out += [md_table(table), ""]
        g = steps[steps["scenario"].isin(rows["scenario"])] if len(steps) else steps
        if not len(g):
            out += ["_Per-step losses and diffs: not measured._", ""]
            continue
        ref = steps[steps["scenario"] == ref_id] if ref_id else None
        # dropna=False: a step whose loss went NaN is a row to show, not one to drop
        loss = g.pivot_table(index="step", columns="world_size", values="loss", aggfunc="first", dropna=False)
        if ref is not None and len(ref):
            loss["reference"] = ref.set_index("step")["loss"]
        picked = _pick_steps(list(loss.index))
        show = loss.reindex(picked).map(lambda x: num(x, ".10g"))
        show.columns = [f"W={c}" if c != "reference" else c for c in show.columns]
        out += ["#### Loss per iteration", "", md_table(show.reset_index()), "",
                _plot(plots.plot_loss, plots_dir / f"loss-{slug}.png", rel, f"loss {label}", g, ref,
                      f"loss: {label}"), ""]
        diff = g.pivot_table(index="step", columns="world_size", values="max_diff_ref", aggfunc="first",
                             dropna=False).reindex(index=loss.index)
        show = diff.reindex(picked).map(num)
        show.columns = [f"W={c}" for c in show.columns]
        bounds = {}
        if len(verdicts):  # only the bounds held against this plot's quantity, |param diff| vs reference
            vb = verdicts[verdicts["scenario"].isin(rows["scenario"])
                          & verdicts["check"].map(lambda c: DIFF_COLUMN.get(c) == "max_diff_ref")]
            vb = vb.assign(bound=pd.to_numeric(vb["bound"], errors="coerce")).dropna(subset=["bound"])
            bounds = {c: float(b) for c, b in zip(vb["check"], vb["bound"]) if b > 0}
        out += ["#### Max |param diff| vs reference per step", "", md_table(show.reset_index()), "",
                _plot(plots.plot_diff, plots_dir / f"diff-{slug}.png", rel, f"param diff {label}", g,
                      f"max |param diff| vs reference: {label}", bounds=bounds), ""]
    return out


def _memory_section(tables: dict, plots_dir: Path, rel: str) -> list[str]:
    cells, mem = _cells(tables), _t(tables, "memory")
    out = ["## Memory", "", "Bytes per rank (max over ranks) by category and world size."
           + (" Cells read `measured (ideal)`." if "ideal_bytes" in mem else ""), ""]
    groups = _groups(cells)
    if not groups or (not len(mem) and "state_bytes" not in cells):
        return out + ["_Memory: not measured._", ""]
    for key, rows in groups:
        out += [f"### {_label(key)}", ""]
        m = mem[mem["scenario"].isin(rows["scenario"])] if len(mem) else mem
        if len(m):
            m = m.merge(rows[["scenario", "world_size"]], on="scenario")
            agg = {"bytes": "max", **({"ideal_bytes": "max"} if "ideal_bytes" in m else {})}
            cat = m.groupby(["category", "world_size"]).agg(agg)
            cell = cat.apply(lambda r: human_bytes(r["bytes"]) + (f" ({human_bytes(r['ideal_bytes'])})"
                                                                   if "ideal_bytes" in r else ""), axis=1)
            table = cell.unstack("world_size")
            order = [c for c in MEM_ORDER if c in table.index] + sorted(set(table.index) - set(MEM_ORDER))
            table = table.loc[order]
            st = rank_bytes(m, "state_total").rename("bytes").reset_index().merge(rows[["scenario", "world_size"]])
            if len(st):
                by = st.groupby("world_size")["bytes"]
                table.loc["rank balance (state max/min)"] = (by.max() / by.min()).map(lambda x: f"{x:.2f}")
            table.columns = [f"W={c}" for c in table.columns]
            out += [md_table(table.rename_axis("category").reset_index()), ""]
        else:
            out += ["_Per-category breakdown: not measured._", ""]
        per_ws = _per_ws(rows, mem)
        if per_ws[["state_bytes", "peak_bytes"]].notna().any().any():
            out += [_plot(plots.plot_memory, plots_dir / f"memory-{_slug(key)}.png", rel, f"memory {_label(key)}",
                          per_ws, f"memory per rank: {_label(key)}"), ""]
    return out


def _comm_section(tables: dict) -> list[str]:
    comm, cells = _t(tables, "comm"), _cells(tables)
    out = ["## Communication", "", "Per training step on rank 0, per collective and element type, in elements "
           "and bytes of the full size each collective handles. ZeRO-3 ideal: 2 all-gathers and 1 reduce-scatter "
           "of the parameters per step, (W-1)/W of their bytes each on the wire.", ""]
    if not len(comm) or not len(cells):
        return out + ["_Communication: not measured._", ""]
    for key, rows in _groups(cells):
        c = comm.merge(rows[["scenario", "world_size"]], on="scenario").sort_values(["world_size", "collective"])
        out += [f"### {_label(key)}", ""]
        if not len(c):
            out += ["_No collectives recorded._", ""]
            continue
        col = lambda name: c[name] if name in c else pd.Series(np.nan, index=c.index)  # noqa: E731
        t = pd.DataFrame({"world size": c["world_size"], "collective": c["collective"],
                          "dtype": col("dtype").fillna("").astype(str),
                          "calls per step": [num(x, "g") for x in c["calls"]],
                          "elements per step": [num(x, ",.0f" if float(x).is_integer() else ",.6g")
                                                for x in col("elements")],
                          "bytes per step": [human_bytes(x) for x in c["bytes"]],
                          "bytes (exact)": [num(x, ".0f" if float(x).is_integer() else ".6g") for x in c["bytes"]]})
        if "ideal_bytes" in c:
            t["ideal bytes"] = [human_bytes(x) for x in c["ideal_bytes"]]
        missing = sorted(set(rows["world_size"]) - set(c["world_size"]))
        out += [md_table(t), ""] + ([f"No collectives at W={', '.join(map(str, missing))}.", ""] if missing else [])
    return out


def _env_section(env: dict) -> list[str]:
    if not env:
        return ["## Environment", "", "_Environment: not recorded._", ""]
    keys = [k for k in ENV_ORDER if k in env] + sorted(k for k in env if k not in ENV_ORDER)
    vals = [" ".join(map(str, env[k])) if isinstance(env[k], (list, tuple)) else str(env[k]) for k in keys]
    return ["## Environment", "", md_table(pd.DataFrame({"key": keys, "value": vals})), ""]


def render(tables: dict, env: dict, title: str, plots_dir: Path, rel: str) -> str:
    """The markdown text; plots are written into `plots_dir` and linked as `rel/<file>`."""
    out = [f"# {title}", "", _overall(_t(tables, "verdicts"), _cells(tables)), ""]
    out += _verdict_sections(tables) + _group_sections(tables, plots_dir, rel)
    out += _memory_section(tables, plots_dir, rel) + _comm_section(tables) + per_sample_section(tables)
    out += _env_section(env or {})
    return "\n".join(out).rstrip() + "\n"


def write_report(tables: dict, env: dict, path: Path, *, title: str = "FSDP equivalence verification") -> Path:
    """Write `path` (markdown) and `<stem>_plots/` beside it, atomically; returns `path`. A write
    that fails raises harness.tables.store.OutputError (one line) and leaves the earlier report in place."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.stem}.tmp-"))
        try:
            swap_into_place(stage_report(tables, env, path, tmp, title=title))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def stage_report(tables: dict, env: dict, path: Path, tmp: Path, *,
                 title: str = "FSDP equivalence verification") -> list[tuple[Path, Path]]:
    """Render the report and its plots into `tmp`; the (staged, final) pairs for `swap_into_place`."""
    path = Path(path)
    plots_name = f"{path.stem}_plots"
    (tmp / plots_name).mkdir()
    (tmp / path.name).write_text(render(tables, env, title, tmp / plots_name, plots_name), encoding="utf-8")
    return [(tmp / plots_name, path.parent / plots_name), (tmp / path.name, path)]
