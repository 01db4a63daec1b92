"""Baseline files: a committed, diffable record of per-scenario gate figures, one file per machine kind.

The baseline is pretty JSON with sorted keys (one value per line, so `git diff` shows exactly which
step's loss moved). Files are kept one per machine kind: `reports/baselines/<name>/<kind>.json` with kind =
device-capability-torch (`harness.core.environment.machine_kind`, e.g. cpu-avx512-torch2.13.0_cpu).
`--baseline NAME` reads the file of the kind the run is on; where that kind has none, the file of
another CPU kind with the same device and torch version gates memory and traffic, and the
verdicts say plainly that losses were not gated; with only other devices or torch versions on
file, nothing is gated and the verdicts say so (torch's own FSDP moves its memory and traffic
between versions). Beside the figures a file records the run's configuration
(harness.gate.configuration: lr, steps, global batch, seeds, features, models, ...), so that a run
made another way is told so rather than failed; a file saved before it did has none (None: unknown).
The comparison itself is harness.gate.compare.

A name is looked up under `reports/baselines/` relative to the current directory (DEFAULT_DIR), as the
default report goes to `reports/runs/` there: run from the checkout to use its committed baselines, or give
a path. A baseline is named as it was asked for (the name, or the path given), never by the name stored in
its file, which a copied or renamed baseline keeps.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness.core.environment import machine_kind
from harness.gate.configuration import configuration_of
from harness.gate.tolerance import DEFAULT_TOLERANCES
from harness.tables.store import rank_bytes, write_text_atomic

FORMAT, VERSION = "fsdp-equivalence-baseline", 1
DEFAULT_DIR = Path("reports/baselines")
SCALARS = (
    "final_loss",
    "max_diff_ref",
    "max_diff_ws1",
    "peak_mem",
    "state_mem",
    "comm_bytes",
    "comm_calls",
    "step_time",
)


class BaselineError(Exception):
    """A baseline that cannot be used; the message is one line naming the file and the problem."""


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
        status = "unsupported" if row.get("status") == "unsupported" else "error" if err and err != "nan" else "ok"
        # every run that finished counted its collectives: none (one rank) is 0, not "not measured";
        # only a run that did not finish, or tables stored without a comm table, measured no traffic
        traffic = status == "ok" and "comm" in tables
        out[sid] = {
            "status": status,
            "loss": [_f(x) for x in s.get("loss", [])],
            "final_loss": _f(row.get("final_loss")),
            "max_diff_ref": _f(row.get("max_diff_ref")),
            "max_diff_ws1": _f(row.get("max_diff_ws1")),
            "peak_mem": _f(mem_of("peak") if pd.isna(row.get("peak_bytes", np.nan)) else row["peak_bytes"]),
            "state_mem": _f(mem_of("state_total") if pd.isna(row.get("state_bytes", np.nan)) else row["state_bytes"]),
            "first_step": _f(s["step"].iloc[0]) if len(s) else 1,
            "comm_bytes": _f(c["bytes"].sum() if len(c) else 0.0) if traffic else None,
            "comm_calls": _f(c["calls"].sum() if len(c) else 0.0) if traffic else None,
            "step_time": _f(row.get("step_time_s")),
            **{
                k: _f(row[k]) if k in ("world_size", "seed") else str(row[k])
                for k in ("impl", "model", "world_size", "data_mode", "optimizer", "seed")
                if k in row
            },
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
    # the configuration of the run it was saved from (harness.gate.configuration); None: not recorded
    configuration: dict | None = None

    @property
    def kind(self) -> str:
        return machine_kind(self.env)


def jsonable_env(env: dict) -> dict:
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
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "env": jsonable_env(dict(env or {})),
        "configuration": configuration_of(tables, env),
        "tolerances_default": {f: str(t) for f, t in DEFAULT_TOLERANCES.items()},
        "scenarios": summarize(tables),
    }
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
    where = f" (relative to the current directory, {Path.cwd()})" if not Path(directory).is_absolute() else ""
    raise BaselineError(
        f"baseline not found: no {folder}/*.json{where}; run from the checkout that holds it, give its path, or save "
        f"one with --save-baseline {name}"
    )


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
        raise BaselineError(
            f"baseline {path} has version {doc.get('version')!r}, this harness reads version {VERSION}; re-save it"
        )
    if not isinstance(doc.get("scenarios"), dict) or not isinstance(doc.get("env", {}), dict):
        raise BaselineError(f"baseline {path} is malformed: 'scenarios' and 'env' must be objects")
    if not isinstance(doc.get("configuration", {}), dict):
        raise BaselineError(f"baseline {path} is malformed: 'configuration' must be an object")
    for sid, entry in doc["scenarios"].items():
        _check_entry(path, sid, entry)
    return Baseline(
        s,  # as asked for (see the module docstring)
        path,
        doc.get("env", {}),
        doc["scenarios"],
        wanted,
        configuration=doc.get("configuration"),
    )


def baseline_of_run(tables: dict, env: dict, name: str, path: Path) -> Baseline:
    """Another stored run seen as a baseline, so that `compare A B` applies the gate's rules."""
    return Baseline(
        name, Path(path), jsonable_env(dict(env or {})), summarize(tables), configuration=configuration_of(tables, env)
    )
