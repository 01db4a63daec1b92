"""Regression gate: a committed, diffable baseline of per-scenario figures, compared field by field.

The baseline is pretty JSON with sorted keys (one value per line, so `git diff` shows exactly which
step's loss moved). Gate fields and their default tolerances (override with parse_gate):

    loss        per-step global loss, any direction            1e-7 absolute (about 1 fp32 ulp at 1.0)
    max_diff    final max |param diff| vs reference and 1 rank 10%, increases only (0 stays 0: exact)
    peak_mem    peak bytes per rank                            5% (at least 4096 B), increases only
    state_mem   params+grads+optimizer bytes per rank          1%, increases only
    comm_bytes  bytes moved per step (all collectives)         0, any direction
    comm_calls  collective calls per step                      0, any direction
    step_time   seconds per step                               off (timing is noisy on shared CPUs)

compare() returns Verdicts "gate:<field>" (one per scenario x field; a field whose gate is off gets
one run-wide SKIP instead), "gate:scenario" for scenarios missing on either side (FAIL when the run
lacks a baseline scenario unless allow_missing, SKIP for a new one, FAIL when a scenario that ran in
the baseline errored now), and "gate:env" SKIP verdicts, one per differing environment key (keys in
VOLATILE_ENV such as date and git_commit are ignored): append them to the verdicts table and the
report lists them under "Skipped checks", so the warnings are always visible.

Two environment facts change what can be compared at all:
- Numeric kernels (NUMERIC_ENV: torch version, device, ``cpu_capability`` such as AVX2 or AVX512,
  the CPU model, the GPU): ATen, oneDNN and MKL pick different vectorised kernels and blockings, so
  losses and parameter diffs of the same code differ in the last bits between machines (measured:
  tinylm step-2 loss moves by 4.8e-7, and a split-data max diff doubles, between two CI hosts). Unless
  every one of these keys is recorded alike on both sides, ``loss`` and ``max_diff`` are SKIP for
  every scenario, with the reason; memory, traffic and the rest are still gated.
- Peak memory on gloo is not exactly repeatable: gloo's worker thread drops its reference to a
  collective's buffers after the caller's ``wait()`` returns, so whether one such buffer is still
  alive at the step's peak is a race (measured: +2236 B on the mlp at 2 ranks, in 1 of 8 repeats,
  for fsdp_impl and FSDP2 alike). The peak_mem tolerance has an absolute floor for that reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.store import rank_bytes, write_text_atomic
from harness.verdict import FAIL, PASS, SKIP, Verdict

FORMAT, VERSION = "fsdp-equivalence-baseline", 1
DEFAULT_DIR = Path("reports/baselines")
# Environment keys expected to differ between any two runs: never warned about.
VOLATILE_ENV = {"date", "command", "git_commit", "hostname", "duration_s", "time"}
# Environment keys that choose the numeric kernels: losses and diffs are only comparable when all match.
NUMERIC_ENV = ("torch", "device", "cpu_capability", "cpu", "gpu")
SCALARS = ("final_loss", "max_diff_ref", "max_diff_ws1", "peak_mem", "state_mem", "comm_bytes", "comm_calls",
           "step_time")


class BaselineError(Exception):
    """A baseline that cannot be used; the message is one line naming the file and the problem."""


class GateSpecError(ValueError, argparse.ArgumentTypeError):
    """A bad --gate spec (a ValueError that argparse also prints verbatim)."""


@dataclass(frozen=True)
class Tolerance:
    value: float = 0.0  # absolute, or a fraction of |baseline| when relative
    relative: bool = False
    off: bool = False
    floor: float = 0.0  # a relative tolerance allows at least this much (absolute)

    def allowed(self, base: float) -> float:
        return max(self.value * abs(base), self.floor) if self.relative else self.value

    def fails(self, current: float, base: float, two_sided: bool = True) -> bool:
        delta = current - base
        return not self.off and (abs(delta) if two_sided else delta) > self.allowed(base)

    def __str__(self) -> str:
        if self.off:
            return "off"
        if not self.relative:
            return f"{self.value:g}"
        return f"{self.value * 100:g}%" + (f"min{self.floor:g}" if self.floor else "")


# field -> (default tolerance, two-sided?)
FIELDS: dict[str, tuple[Tolerance, bool]] = {
    "loss": (Tolerance(1e-7), True), "max_diff": (Tolerance(0.10, relative=True), False),
    "peak_mem": (Tolerance(0.05, relative=True, floor=4096), False), "state_mem": (Tolerance(0.01, relative=True), False),
    "comm_bytes": (Tolerance(0), True), "comm_calls": (Tolerance(0), True), "step_time": (Tolerance(off=True), False),
}
# Fields whose values depend on the CPU's kernel set (see the module docstring).
KERNEL_DEPENDENT = ("loss", "max_diff")
DEFAULT_TOLERANCES = {f: t for f, (t, _) in FIELDS.items()}


def parse_gate(spec: str) -> dict[str, Tolerance]:
    """'loss:1e-7,peak_mem:5%,step_time:off' -> every field's Tolerance (defaults for fields not named).

    A percentage may carry an absolute minimum: 'peak_mem:5%min4096' allows max(5%, 4096)."""
    out, seen = dict(DEFAULT_TOLERANCES), set()
    for item in filter(None, (p.strip() for p in (spec or "").split(","))):
        field, sep, raw = (s.strip() for s in item.partition(":"))
        if not sep or not raw:
            raise GateSpecError(f"gate item '{item}' must be FIELD:TOLERANCE, e.g. loss:1e-7 or peak_mem:5%")
        if field not in FIELDS:
            raise GateSpecError(f"unknown gate field '{field}' (known: {', '.join(FIELDS)})")
        if field in seen:
            raise GateSpecError(f"gate field '{field}' given twice")
        seen.add(field)
        if raw.lower() == "off":
            out[field] = Tolerance(off=True)
            continue
        num, _, floor_s = raw.lower().partition("min")
        pct = num.endswith("%")
        try:
            value = float(num[:-1] if pct else num)
            floor = float(floor_s) if floor_s else 0.0
        except ValueError:
            value = floor = math.nan
        if not (math.isfinite(value) and math.isfinite(floor)) or value < 0 or floor < 0 or (floor_s and not pct):
            raise GateSpecError(f"gate '{item}': '{raw}' is not a number >= 0, a percentage like 5% "
                                f"(optionally with a minimum, 5%min4096), or 'off'")
        out[field] = Tolerance(value / 100 if pct else value, relative=pct, floor=floor)
    return out


def _f(v) -> float | int | None:
    """A JSON number: None for missing/NaN, int for integer dtypes, float otherwise."""
    if v is None or pd.isna(v):
        return None
    return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else float(v)


def summarize(tables: dict) -> dict[str, dict]:
    """Per-scenario gate figures from a run's tables (JSON-ready: None where not measured)."""
    get = lambda n: tables.get(n) if isinstance(tables.get(n), pd.DataFrame) else pd.DataFrame()  # noqa: E731
    scen, steps, mem, comm = get("scenarios"), get("steps"), get("memory"), get("comm")
    ids = list(scen["scenario"]) if len(scen) else list(dict.fromkeys(steps["scenario"])) if len(steps) else []
    out = {}
    for sid in ids:
        row = scen[scen["scenario"] == sid].iloc[0] if len(scen) else pd.Series(dtype=object)
        m = mem[mem["scenario"] == sid] if len(mem) else mem
        mem_of = lambda cat: rank_bytes(m, cat).max() if len(m) else None  # noqa: E731
        c = comm[comm["scenario"] == sid] if len(comm) else comm
        s = steps[steps["scenario"] == sid].sort_values("step") if len(steps) else steps
        err = str(row.get("error", "") or "")
        out[sid] = {
            "status": "error" if err and err != "nan" else "ok", "loss": [_f(x) for x in s.get("loss", [])],
            "final_loss": _f(row.get("final_loss")), "max_diff_ref": _f(row.get("max_diff_ref")),
            "max_diff_ws1": _f(row.get("max_diff_ws1")),
            "peak_mem": _f(mem_of("peak") if pd.isna(row.get("peak_bytes", np.nan)) else row["peak_bytes"]),
            "state_mem": _f(mem_of("state_total") if pd.isna(row.get("state_bytes", np.nan)) else row["state_bytes"]),
            "first_step": _f(s["step"].iloc[0]) if len(s) else 1,
            "comm_bytes": _f(c["bytes"].sum()) if len(comm) else None,
            "comm_calls": _f(c["calls"].sum()) if len(comm) else None, "step_time": _f(row.get("step_time_s")),
            **{k: _f(row[k]) if k in ("world_size", "seed") else str(row[k])
               for k in ("impl", "model", "world_size", "data_mode", "optimizer", "seed") if k in row},
        }
    return out


@dataclass(frozen=True)
class Baseline:
    name: str
    path: Path
    env: dict
    scenarios: dict[str, dict]


def _jsonable_env(env: dict) -> dict:
    return {str(k): v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for k, v in env.items()}


def save_baseline(tables: dict, env: dict, name: str, directory: Path = DEFAULT_DIR) -> Path:
    """Write `<directory>/<name>.json` atomically and return its path."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name or ""):
        raise ValueError(f"baseline name '{name}' must be letters, digits, '_', '-', '.' (no path)")
    doc = {"format": FORMAT, "version": VERSION, "name": name, "env": _jsonable_env(dict(env or {})),
           "tolerances_default": {f: str(t) for f, t in DEFAULT_TOLERANCES.items()}, "scenarios": summarize(tables)}
    return write_text_atomic(Path(directory) / f"{name}.json",
                             json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n")


def _check_entry(path: Path, sid: str, entry) -> None:
    num = lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))  # noqa: E731
    if not isinstance(entry, dict):
        raise BaselineError(f"baseline {path} is malformed: scenario '{sid}' is not an object")
    missing = [k for k in ("loss", "status", *SCALARS) if k not in entry]
    if missing:
        raise BaselineError(f"baseline {path} is malformed: scenario '{sid}' lacks {missing}")
    if not isinstance(entry["loss"], list) or not all(num(x) for x in entry["loss"]):
        raise BaselineError(f"baseline {path} is malformed: scenario '{sid}' loss is not a list of numbers")
    bad = [k for k in SCALARS if not num(entry[k])]
    if bad:
        raise BaselineError(f"baseline {path} is malformed: scenario '{sid}' fields {bad} are not numbers")


def load_baseline(name_or_path: str | Path, directory: Path = DEFAULT_DIR) -> Baseline:
    """Read a baseline by name (from `directory`) or by path; BaselineError (one line) if unusable."""
    s = str(name_or_path)
    path = Path(s) if isinstance(name_or_path, Path) or "/" in s or os.sep in s or s.endswith(".json") \
        else Path(directory) / f"{s}.json"
    if not path.is_file():
        raise BaselineError(f"baseline not found: {path} (save one with save_baseline / --save-baseline)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BaselineError(f"baseline {path} is corrupt: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BaselineError(f"baseline {path} is not a baseline file (format is not '{FORMAT}')")
    if doc.get("version") != VERSION:
        raise BaselineError(f"baseline {path} has version {doc.get('version')!r}, this harness reads version "
                            f"{VERSION}; re-save it")
    if not isinstance(doc.get("scenarios"), dict) or not isinstance(doc.get("env", {}), dict):
        raise BaselineError(f"baseline {path} is malformed: 'scenarios' and 'env' must be objects")
    for sid, entry in doc["scenarios"].items():
        _check_entry(path, sid, entry)
    return Baseline(str(doc.get("name", path.stem)), path, doc.get("env", {}), doc["scenarios"])


def _elements(field: str, e: dict) -> list[tuple[str, float | None]]:
    if field == "loss":
        return [(f"step {int(e.get('first_step') or 1) + i}", v) for i, v in enumerate(e["loss"])]
    if field == "max_diff":
        return [("vs reference", e["max_diff_ref"]), ("vs 1 rank", e["max_diff_ws1"])]
    return [("", e[field])]


def _field(field: str, sid: str, base: dict, cur: dict, tol: Tolerance) -> tuple:
    """(status, measured, bound, where, message, baseline value, current value) for one scenario x field."""
    two_sided = FIELDS[field][1]
    b_el, c_el = _elements(field, base), _elements(field, cur)
    b_vals = [v for _, v in b_el if v is not None]
    c_vals = [v for _, v in c_el if v is not None]
    head = f"{field} of {sid}"
    if tol.off:
        return SKIP, None, None, "", f"{head}: gate off for this field", b_vals[-1:] or [None], c_vals[-1:] or [None]
    if len(b_el) != len(c_el):
        return FAIL, len(c_el), len(b_el), "", f"{head}: {len(b_el)} values in baseline, {len(c_el)} now", None, None
    if not b_vals and not c_vals:
        return SKIP, None, None, "", f"{head}: not measured in baseline nor in this run", None, None
    worst = None
    for (where, b), (_, c) in zip(b_el, c_el):
        if b is None or c is None:
            if b is not None:
                return FAIL, None, None, where, f"{head}: baseline has {b}, this run did not measure it", b, None
            continue
        delta = c - b if not two_sided else abs(c - b)
        item = (where, b, c, delta, tol.allowed(b))
        if tol.fails(c, b, two_sided):
            worst = item
            break
        worst = max(worst or item, item, key=lambda t: t[3] - t[4])
    if worst is None:
        return SKIP, None, None, "", f"{head}: not measured in the baseline (re-save it to gate this field)", None, None
    where, b, c, delta, allowed = worst
    loc = f" at {where}" if where.startswith("step") else f" ({where})" if where else ""
    tol_s = f"{tol} (= {allowed:g})" if tol.relative else str(tol)
    if tol.fails(c, b, two_sided):
        msg = (f"{head} regressed{loc}: baseline {b:.10g}, current {c:.10g}, change {c - b:+.3g} "
               f"exceeds tolerance {tol_s}")
        return FAIL, delta, allowed, where, msg, b, c
    msg = f"{head} within tolerance {tol_s}{loc}: baseline {b:.10g}, current {c:.10g}"
    return PASS, delta, allowed, where if delta else "", msg, b, c


def env_warnings(env: dict | None, baseline: Baseline) -> list[tuple[str, str]]:
    """(key, sentence) for every non-volatile environment key that differs from the baseline's."""
    if env is None:
        return []
    cur, base = _jsonable_env(env), baseline.env
    keys = sorted((set(cur) | set(base)) - VOLATILE_ENV)
    return [(k, f"environment differs from baseline '{baseline.name}': {k} was {base.get(k)!r}, now "
                f"{cur.get(k)!r}; figures may move for this reason") for k in keys if cur.get(k) != base.get(k)]


def kernel_mismatch(env: dict | None, baseline: Baseline) -> str:
    """A sentence when this run and the baseline may have used different numeric kernels, else ''.

    Kernels are the same only when every key of NUMERIC_ENV is recorded alike on both sides; a
    baseline that did not record one (an older file) cannot prove it, so it counts as different.
    Without this run's environment (env None) nothing is assumed: the fields are compared."""
    if env is None:
        return ""
    cur = _jsonable_env(env)
    differ = [k for k in NUMERIC_ENV if cur.get(k) != baseline.env.get(k)]
    if not differ:
        return ""
    said = "; ".join(f"{k} {baseline.env.get(k, 'not recorded')!r} there, {cur.get(k, 'not recorded')!r} here"
                     for k in differ)
    return (f"baseline '{baseline.name}' may have run on other numeric kernels ({said}): losses and "
            f"parameter diffs differ in the last bits between kernel sets, so they are not compared "
            f"(re-save the baseline on this kind of machine to gate them)")


def _resolve(tolerances: dict | None) -> dict[str, Tolerance]:
    unknown = set(tolerances or {}) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown gate fields {sorted(unknown)} (known: {', '.join(FIELDS)})")
    return {**DEFAULT_TOLERANCES, **(tolerances or {})}


def compare(tables: dict, baseline: Baseline | str | Path, tolerances: dict | None = None, *,
            env: dict | None = None, allow_missing: bool = False) -> list[Verdict]:
    """Gate verdicts for this run's tables against `baseline` (see the module docstring)."""
    base = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    tols, cur = _resolve(tolerances), summarize(tables)
    out = [Verdict("gate:env", "", SKIP, None, None, k, msg) for k, msg in env_warnings(env, base)]
    out += [Verdict(f"gate:{f}", "", SKIP, None, None, "", f"gate off for {f} (enable with e.g. {f}:50%)")
            for f, t in tols.items() if t.off]
    mismatch = kernel_mismatch(env, base)
    if mismatch:
        out += [Verdict(f"gate:{f}", "", SKIP, None, None, "", mismatch) for f in KERNEL_DEPENDENT if not tols[f].off]
        tols = {f: t for f, t in tols.items() if f not in KERNEL_DEPENDENT}
    for sid in list(base.scenarios) + [s for s in cur if s not in base.scenarios]:
        if sid not in cur:
            out.append(Verdict("gate:scenario", sid, SKIP if allow_missing else FAIL, None, None, "",
                               f"scenario {sid} is in baseline '{base.name}' but was not run"))
        elif sid not in base.scenarios:
            out.append(Verdict("gate:scenario", sid, SKIP, None, None, "", f"new scenario {sid} is not in baseline "
                               f"'{base.name}': not gated (re-save the baseline to cover it)"))
        elif cur[sid]["status"] != "ok" and base.scenarios[sid]["status"] == "ok":
            out.append(Verdict("gate:scenario", sid, FAIL, None, None, "", f"scenario {sid} errored in this run"))
        else:
            for field, tol in ((f, t) for f, t in tols.items() if not t.off):
                st, m, b, where, msg, *_ = _field(field, sid, base.scenarios[sid], cur[sid], tol)
                out.append(Verdict(f"gate:{field}", sid, st, m, b, where, msg))
    return out


def compare_table(tables_a: dict, b: dict | Baseline | str | Path, tolerances: dict | None = None) -> pd.DataFrame:
    """Side by side: scenario | field | baseline | current | change | tolerance | status (a = current run)."""
    if not isinstance(b, (Baseline, dict)):
        b = load_baseline(b)
    base = b.scenarios if isinstance(b, Baseline) else summarize(b)
    tols, cur, rows = _resolve(tolerances), summarize(tables_a), []
    for sid in list(base) + [s for s in cur if s not in base]:
        if sid not in cur or sid not in base:
            rows.append(dict(scenario=sid, field="scenario", baseline="present" if sid in base else "absent",
                             current="present" if sid in cur else "absent", change=None, tolerance="", status=FAIL
                             if sid not in cur else SKIP, where=""))
            continue
        for field, tol in tols.items():
            st, _, _, where, _, bv, cv = _field(field, sid, base[sid], cur[sid], tol)
            bv, cv = (bv[0] if isinstance(bv, list) else bv), (cv[0] if isinstance(cv, list) else cv)
            change = cv - bv if isinstance(bv, (int, float)) and isinstance(cv, (int, float)) else None
            rows.append(dict(scenario=sid, field=field, baseline=bv, current=cv, change=change,
                             tolerance=str(tol), status=st, where=where))
    return pd.DataFrame(rows, columns=["scenario", "field", "baseline", "current", "change", "tolerance", "status",
                                       "where"])
