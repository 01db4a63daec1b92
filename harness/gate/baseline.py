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

Files are kept one per machine kind: `reports/baselines/<name>/<kind>.json` with kind =
device-capability-torch (`harness.core.environment.machine_kind`, e.g. cpu-avx512-torch2.13.0_cpu).
`--baseline NAME` reads the file of the kind the run is on; where that kind has none, the file of
another CPU kind with the same device and torch version gates memory and traffic, and the
verdicts say plainly that losses were not gated; with only other devices or torch versions on
file, nothing is gated and the verdicts say so (torch's own FSDP moves its memory and traffic
between versions).

`comparison()` is the one comparison; the gate's verdicts (`compare`) and the `compare` command's
table (`compare_table`) are two views of its rows: "gate:<field>" per scenario x field (a field
whose gate is off gets one run-wide SKIP instead), "gate:scenario" SKIP for a scenario on one side
only (a run of part of the matrix is gated on what it ran), FAIL for a scenario that ran in the
baseline and errored now, and "gate:env" SKIP notes, one per differing environment key (keys in
VOLATILE_ENV such as date and git_commit are ignored), so the differences are always visible.

Two environment facts change what can be compared at all:
- Numeric kernels (NUMERIC_ENV: torch version, device, ``cpu_capability`` such as AVX2 or AVX512,
  the CPU's name, the GPU): ATen, oneDNN and MKL pick different vectorised kernels and blockings, so
  losses and parameter diffs of the same code differ in the last bits between machines (measured:
  tinylm step-2 loss moves by 4.8e-7, and a split-data max diff doubles, between two CI hosts). Unless
  every one of these keys is recorded alike on both sides, ``loss`` and ``max_diff`` are SKIP for
  every scenario, with the reason; memory, traffic and the rest are still gated. The CPU counts by
  its name without the family and model numbers (``cpu_name``): two generations under one name and
  capability run the same kernels (measured: "AMD EPYC" family 25 model 17 and family 26 model 2,
  both AVX512, agree bitwise on all 204 losses and diffs of the default matrix), and MKL chooses its
  code path by vendor, which the name carries.
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

from harness.core.environment import machine_kind
from harness.core.verdict import FAIL, PASS, SKIP, Verdict
from harness.tables.store import rank_bytes, write_text_atomic

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

    A percentage may carry an absolute minimum: 'peak_mem:5%min4096' allows max(5%, 4096); without
    one it keeps the field's default minimum ('peak_mem:5%' still allows 4096 B; '5%min0' drops it)."""
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
        if pct and not floor_s:  # '5%' alone keeps the field's own floor (peak_mem: 4096 B, see above)
            floor = DEFAULT_TOLERANCES[field].floor
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
    # set when no file of the run's machine kind exists and another kind's was taken: memory and
    # traffic are gated against it, losses and diffs are not (their kernels differ)
    wanted_kind: str = ""
    # False when the name has files only for other devices or torch versions: nothing is gated
    comparable: bool = True

    @property
    def kind(self) -> str:
        return machine_kind(self.env)


def _jsonable_env(env: dict) -> dict:
    return {str(k): v if isinstance(v, (str, int, float, bool)) or v is None else str(v) for k, v in env.items()}


NAME_RULE = r"[A-Za-z0-9][A-Za-z0-9_.-]*"


def baseline_file(name: str, env: dict, directory: Path = DEFAULT_DIR) -> Path:
    """`<directory>/<name>/<machine kind>.json`: one file per machine kind, so a baseline saved on
    one kind never replaces another kind's."""
    if not re.fullmatch(NAME_RULE, name or "") or name in (".", ".."):
        raise ValueError(f"baseline name '{name}' must be letters, digits, '_', '-', '.' (no path)")
    return Path(directory) / name / f"{machine_kind(env or {})}.json"


def baseline_text(tables: dict, env: dict, name: str) -> str:
    """The baseline document: pretty JSON, sorted keys, one value per line."""
    doc = {"format": FORMAT, "version": VERSION, "name": name, "env": _jsonable_env(dict(env or {})),
           "tolerances_default": {f: str(t) for f, t in DEFAULT_TOLERANCES.items()}, "scenarios": summarize(tables)}
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"


def save_baseline(tables: dict, env: dict, name: str, directory: Path = DEFAULT_DIR) -> Path:
    """Write the baseline of this run's machine kind atomically (`baseline_file`); returns its path."""
    return write_text_atomic(baseline_file(name, env, directory), baseline_text(tables, env, name))


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


def _pick_file(name: str, directory: Path, kind: str | None) -> tuple[Path | None, str]:
    """(file, the kind wanted but missing or '') for a baseline name: the file of this machine kind
    when there is one; else one of another CPU kind with the same device and torch version (memory
    and traffic compare across CPU kinds, losses do not); else None: the files there were made
    with another torch or device, whose own implementations' memory and traffic differ. A legacy
    `<name>.json` is read when the folder does not exist."""
    folder = Path(directory) / name
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if kind and (folder / f"{kind}.json").is_file():
        return folder / f"{kind}.json", ""
    if files:
        device, *_, torch_version = (kind or "--").split("-")
        alike = [f for f in files if f.stem.split("-")[0] == device and f.stem.split("-")[-1] == torch_version]
        return (alike[0] if alike else None), kind or ""
    legacy = Path(directory) / f"{name}.json"
    if legacy.is_file():
        return legacy, ""
    raise BaselineError(f"baseline not found: no {folder}/*.json (save one with --save-baseline {name})")


def load_baseline(name_or_path: str | Path, directory: Path = DEFAULT_DIR, *, kind: str | None = None) -> Baseline:
    """Read a baseline by name or by path; BaselineError (one line) if unusable.

    A name picks `<directory>/<name>/<kind>.json`, the file of this machine kind (`kind`, from
    `harness.core.environment.machine_kind`); without one, another kind's file is taken and
    `Baseline.wanted_kind` says so. A path (with a '/' or ending in .json) is read as it is."""
    s = str(name_or_path)
    wanted = ""
    if isinstance(name_or_path, Path) or "/" in s or os.sep in s or s.endswith(".json"):
        path = Path(s)
    else:
        path, wanted = _pick_file(s, directory, kind)
        if path is None:  # only other devices or torch versions: nothing comparable (see _pick_file)
            return Baseline(s, Path(directory) / s, {}, {}, wanted, comparable=False)
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
    return Baseline(str(doc.get("name", path.stem)), path, doc.get("env", {}), doc["scenarios"], wanted)


def _elements(field: str, e: dict) -> list[tuple[int | None, str, float | None]]:
    """(step, label, value) of one field of one scenario entry: a value per step for the loss."""
    if field == "loss":
        first = int(e.get("first_step") or 1)
        return [(first + i, f"step {first + i}", v) for i, v in enumerate(e["loss"])]
    if field == "max_diff":
        return [(None, "vs reference", e["max_diff_ref"]), (None, "vs 1 rank", e["max_diff_ws1"])]
    return [(None, "", e[field])]


@dataclass(frozen=True)
class GateRow:
    """One scenario x field of the comparison (or a run-wide note): the gate's verdicts and the
    `compare` command's table are two views of the same rows."""

    check: str  # "gate:<field>", "gate:scenario" or "gate:env"
    scenario: str
    status: str
    message: str
    baseline: float | None = None
    current: float | None = None
    delta: float | None = None  # the change held against the tolerance (one-sided fields: increase only)
    allowed: float | None = None
    tolerance: str = ""
    step: int | None = None
    label: str = ""  # display: "vs reference", the environment key, ...

    def verdict(self) -> Verdict:
        return Verdict(self.check, self.scenario, self.status, self.delta, self.allowed,
                       where=self.label if self.step is None else "", message=self.message, step=self.step)


def _field(field: str, sid: str, base: dict, cur: dict, tol: Tolerance) -> GateRow:
    """The comparison of one field of one scenario: the first element over tolerance, else the closest."""
    two_sided = FIELDS[field][1]
    b_el, c_el = _elements(field, base), _elements(field, cur)
    head, check, tol_s = f"{field} of {sid}", f"gate:{field}", str(tol)
    if len(b_el) != len(c_el):
        return GateRow(check, sid, FAIL, f"{head}: {len(b_el)} values in baseline, {len(c_el)} now",
                       len(b_el), len(c_el), tolerance=tol_s)
    worst = None
    for (step, label, b), (*_, c) in zip(b_el, c_el):
        if b is None or c is None:
            if b is not None:
                return GateRow(check, sid, FAIL, f"{head}: baseline has {b}, this run did not measure it", b,
                               tolerance=tol_s, step=step, label=label)
            continue
        delta = c - b if not two_sided else abs(c - b)
        item = (step, label, b, c, delta, tol.allowed(b))
        if tol.fails(c, b, two_sided):
            worst = item
            break
        worst = max(worst or item, item, key=lambda t: t[4] - t[5])
    if worst is None:
        return GateRow(check, sid, SKIP, f"{head}: not measured in the baseline (re-save it to gate this field)",
                       tolerance=tol_s)
    step, label, b, c, delta, allowed = worst
    loc = f" at {label}" if step is not None else f" ({label})" if label else ""
    tol_s = f"{tol} (= {allowed:g})" if tol.relative else tol_s
    failed = tol.fails(c, b, two_sided)
    msg = (f"{head} regressed{loc}: baseline {b:.10g}, current {c:.10g}, change {c - b:+.3g} exceeds tolerance "
           f"{tol_s}" if failed else f"{head} within tolerance {tol_s}{loc}: baseline {b:.10g}, current {c:.10g}")
    return GateRow(check, sid, FAIL if failed else PASS, msg, b, c, delta, allowed, str(tol),
                   step if failed or delta else None, label if failed or delta else "")


def env_warnings(env: dict | None, baseline: Baseline) -> list[tuple[str, str]]:
    """(key, sentence) for every non-volatile environment key that differs from the baseline's."""
    if env is None:
        return []
    cur, base = _jsonable_env(env), baseline.env
    keys = sorted((set(cur) | set(base)) - VOLATILE_ENV)
    return [(k, f"environment differs from baseline '{baseline.name}': {k} was {base.get(k)!r}, now "
                f"{cur.get(k)!r}; figures may move for this reason") for k in keys if cur.get(k) != base.get(k)]


def cpu_name(cpu: str | None) -> str | None:
    """'AMD EPYC (family 25, model 17)' -> 'AMD EPYC': the name without the generation numbers."""
    return None if cpu is None else re.sub(r"\s*\(family [^)]*\)\s*$", "", str(cpu))


def _kernel_fact(env: dict, key: str):
    return cpu_name(env.get(key)) if key == "cpu" else env.get(key)


def kernel_mismatch(env: dict | None, baseline: Baseline) -> str:
    """A sentence when this run and the baseline may have used different numeric kernels, else ''.

    Kernels are the same only when every key of NUMERIC_ENV is recorded alike on both sides; a
    baseline that did not record one (an older file) cannot prove it, so it counts as different.
    Without this run's environment (env None) nothing is assumed: the fields are compared."""
    if env is None:
        return ""
    cur = _jsonable_env(env)
    differ = [k for k in NUMERIC_ENV if _kernel_fact(cur, k) != _kernel_fact(baseline.env, k)]
    if not differ:
        return ""
    if baseline.wanted_kind:
        return (f"baseline '{baseline.name}' has no file for this machine kind ({baseline.wanted_kind}); memory "
                f"and traffic were gated against {baseline.path.name}, losses and parameter diffs were NOT gated "
                f"(their last bits depend on the kernels; save one with --save-baseline {baseline.name})")
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


def comparison(current: dict[str, dict], env: dict | None, base: Baseline,
               tolerances: dict | None = None) -> list[GateRow]:
    """The one comparison of a run's per-scenario figures (`summarize`) with a baseline.

    Rules, the same for the gate and for `compare`: an environment key that differs is a SKIP note
    (gate:env); a field whose gate is off is one run-wide SKIP; losses and diffs are compared only
    on the same numeric kernels (`kernel_mismatch`); a scenario present on one side only is a SKIP
    that names it (a run of part of the matrix is gated on the part it ran); a scenario that ran in
    the baseline and errored now is a FAIL."""
    tols = _resolve(tolerances)
    if not base.comparable:
        why = (f"baseline '{base.name}' has no file for this machine kind ({base.wanted_kind}) nor for another "
               f"CPU kind with this device and torch version: nothing was gated (torch's own implementations "
               f"move memory and traffic between versions; save one with --save-baseline {base.name})")
        return [GateRow(f"gate:{f}", "", SKIP, why) for f, t in tols.items() if not t.off]
    rows = [GateRow("gate:env", "", SKIP, msg, label=k) for k, msg in env_warnings(env, base)]
    rows += [GateRow(f"gate:{f}", "", SKIP, f"gate off for {f} (enable with e.g. {f}:50%)") for f, t in tols.items()
             if t.off]
    mismatch = kernel_mismatch(env, base)
    if mismatch:
        rows += [GateRow(f"gate:{f}", "", SKIP, mismatch) for f in KERNEL_DEPENDENT if not tols[f].off]
        tols = {f: t for f, t in tols.items() if f not in KERNEL_DEPENDENT}
    for sid in list(base.scenarios) + [s for s in current if s not in base.scenarios]:
        if sid not in current:
            rows.append(GateRow("gate:scenario", sid, SKIP, f"scenario {sid} is in baseline '{base.name}' but not "
                                "in this run: not compared"))
        elif sid not in base.scenarios:
            rows.append(GateRow("gate:scenario", sid, SKIP, f"new scenario {sid} is not in baseline '{base.name}': "
                                "not gated (re-save the baseline to cover it)"))
        elif current[sid]["status"] != "ok" and base.scenarios[sid]["status"] == "ok":
            rows.append(GateRow("gate:scenario", sid, FAIL, f"scenario {sid} errored in this run"))
        else:
            rows += [_field(f, sid, base.scenarios[sid], current[sid], t) for f, t in tols.items() if not t.off]
    return rows


def compare(tables: dict, baseline: Baseline | str | Path, tolerances: dict | None = None, *,
            env: dict | None = None) -> list[Verdict]:
    """Gate verdicts for this run's tables against `baseline` (see `comparison`)."""
    base = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    return [r.verdict() for r in comparison(summarize(tables), env, base, tolerances)]


COMPARE_COLUMNS = ["check", "scenario", "status", "baseline", "current", "delta", "allowed", "tolerance", "step",
                   "label", "message"]


def compare_table(tables: dict, baseline: Baseline | str | Path, tolerances: dict | None = None, *,
                  env: dict | None = None) -> pd.DataFrame:
    """The same comparison as `compare`, side by side: one row per scenario x field (a = this run)."""
    base = baseline if isinstance(baseline, Baseline) else load_baseline(baseline)
    rows = comparison(summarize(tables), env, base, tolerances)
    return pd.DataFrame([{c: getattr(r, c) for c in COMPARE_COLUMNS} for r in rows], columns=COMPARE_COLUMNS)


def baseline_of_run(tables: dict, env: dict, name: str, path: Path) -> Baseline:
    """Another stored run seen as a baseline, so that `compare A B` applies the gate's rules."""
    return Baseline(name, Path(path), _jsonable_env(dict(env or {})), summarize(tables))
