"""Save a run's tables as CSV plus a JSON manifest, and load them back to re-render a report.

Layout of a run directory::

    run.json        {"format": "fsdp-equivalence-run", "schema_version": 1, "env": {...},
                     "tables": {name: {"file": "<name>.csv", "columns": [...], "kinds": {...}, "rows": n}}}
    <name>.csv      one per table, exact float round trip (repr precision)

Writes are atomic: everything goes to a temp directory beside the target, which then replaces it.
A write that fails raises OutputError (one line) and leaves no temp or backup entry behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from harness.tables.schema import TABLES

SCHEMA_VERSION = 2  # 2: verdicts carry step, param, rank and sample; the coverage table
FORMAT = "fsdp-equivalence-run"
MANIFEST = "run.json"
# Required columns per known table (harness/tables/schema.py); extra columns are kept.
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {name: t.required_columns for name, t in TABLES.items()}


class StoreError(Exception):
    """A run directory that cannot be read back; the message is one line naming the problem."""


class OutputError(OSError):
    """An output that cannot be written (full disk, no permission, read-only file system, ...).

    Raised by write_text_atomic, swap_into_place, save_tables and harness.report.markdown.write_report (so
    also by harness.gate.baseline.save_baseline); ``str()`` is one line naming the path and the OS
    reason: ``cannot write reports/verification.md: No space left on device``. ``errno`` and
    ``strerror`` are the cause's. When it is raised, the write's temp and backup entries are gone
    and what the path held before is back in place.
    """

    def __init__(self, path, cause: OSError):
        reason = " ".join((cause.strerror or str(cause) or type(cause).__name__).split())
        super().__init__(cause.errno, reason, str(path))

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"


@contextlib.contextmanager
def writing(path):
    """Turn an OSError raised in the block into OutputError naming `path` (an OutputError passes)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        raise OutputError(path, exc) from exc


def check_columns(name: str, df: pd.DataFrame) -> None:
    """Raise StoreError if a non-empty known table lacks schema columns."""
    missing = [c for c in TABLE_COLUMNS.get(name, ()) if c not in df.columns]
    if len(df) and missing:
        raise StoreError(f"table '{name}' lacks schema columns {missing} (schema v{SCHEMA_VERSION})")


def rank_bytes(mem: pd.DataFrame, category: str) -> pd.Series:
    """(scenario, rank) -> bytes of one category; "state_total" falls back to the sum of state_* rows."""
    rows = mem[mem["category"] == category] if len(mem) else mem
    if category == "state_total" and len(mem) and not len(rows):
        rows = mem[mem["category"].astype(str).str.startswith("state_")]
    return rows.groupby(["scenario", "rank"])["bytes"].sum() if len(rows) else pd.Series(dtype=float)


def _kind(dtype) -> str:
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    return "str"


def _jsonable(value):
    """Env values made JSON-safe (paths, versions, tuples become strings or lists)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temp file beside it: readers see the old file or the new one,
    never a part; an interrupted write leaves no temp file behind."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return path


def swap_into_place(moves: list[tuple[Path, Path]]) -> None:
    """Move each src onto its dst (files or folders); if any move fails, every dst is restored.

    A file dst is replaced atomically (os.replace); a folder dst is renamed aside first, so it is
    briefly absent. Backups live beside dst and are removed once every move has succeeded, or once
    restored; OutputError names the dst that failed. A backup that cannot be restored is kept
    (the only copy of the old content).
    """
    done: list[tuple[Path, Path | None]] = []  # (dst, backup of its old content or None)
    folders: list[Path] = []  # backup folders, removed at the end
    try:
        for src, dst in moves:
            backup = None
            if dst.exists():
                folders.append(Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.old-")))
                backup = folders[-1] / dst.name
                if dst.is_dir():
                    os.replace(dst, backup)
                else:
                    os.link(dst, backup)
            done.append((dst, backup))
            os.replace(src, dst)
    except BaseException as exc:
        for moved, backup in reversed(done):
            try:
                _put_back(moved, backup)
            except OSError:
                if backup is not None:
                    folders.remove(backup.parent)
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise OutputError(dst, exc) from exc
        raise
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def _put_back(dst: Path, backup: Path | None) -> None:
    """Undo a move onto `dst`: its old content (`backup`) back in place, or no `dst` if it had none."""
    if backup is not None and dst.is_file() and os.path.samefile(dst, backup):
        return  # a file whose replacement never landed: the old one is still there
    if dst.is_dir():  # only new content can be here: an old folder was moved aside
        shutil.rmtree(dst)
    if backup is not None:
        os.replace(backup, dst)
    elif dst.exists():
        dst.unlink()


def save_tables(tables: dict[str, pd.DataFrame], env: dict, directory: Path) -> None:
    """Write every table as CSV plus run.json into `directory`, atomically replacing an earlier run."""
    directory = Path(directory)
    for name, df in tables.items():
        check_columns(name, df)
    with writing(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
        try:
            swap_into_place([(stage_run(tables, env, tmp / directory.name), directory)])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def stage_run(tables: dict[str, pd.DataFrame], env: dict, folder: Path) -> Path:
    """Write the run's tables and manifest into a new `folder` (to be swapped into place); returns it."""
    for name, df in tables.items():
        check_columns(name, df)
    folder = Path(folder)
    folder.mkdir()
    manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "env": _jsonable(dict(env)), "tables": {}}
    for name, df in sorted(tables.items()):
        file = f"{name}.csv"
        if len(df.columns):
            df.to_csv(folder / file, index=False)
        else:
            (folder / file).write_text("")
        manifest["tables"][name] = {
            "file": file,
            "columns": [str(c) for c in df.columns],
            "kinds": {str(c): _kind(df[c].dtype) for c in df.columns},
            "rows": len(df),
        }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return folder


def _read_table(directory: Path, name: str, meta: dict) -> pd.DataFrame:
    path = directory / meta["file"]
    if not path.is_file():
        raise StoreError(f"run {directory}: table file {meta['file']} is missing")
    columns, kinds = meta["columns"], meta["kinds"]
    if not columns:
        return pd.DataFrame()
    numeric = [c for c in columns if kinds.get(c) in ("int", "float")]
    try:
        df = pd.read_csv(
            path,
            keep_default_na=False,
            na_values={c: ["", "nan", "NaN"] for c in numeric},
            dtype={c: str for c in columns if kinds.get(c) == "str"},
        )
    except (ValueError, pd.errors.ParserError) as exc:
        raise StoreError(f"run {directory}: {meta['file']} is not valid CSV ({str(exc).splitlines()[0]})") from None
    if list(df.columns) != columns:
        raise StoreError(f"run {directory}: {meta['file']} has columns {list(df.columns)}, manifest says {columns}")
    if len(df) != meta["rows"]:
        raise StoreError(f"run {directory}: {meta['file']} has {len(df)} rows, manifest says {meta['rows']}")
    try:
        for c in columns:
            kind = kinds.get(c)
            if kind == "float":
                df[c] = df[c].astype("float64")
            elif kind == "int":
                df[c] = df[c].astype("int64")
            elif kind == "bool":
                df[c] = df[c].map({"True": True, "False": False, True: True, False: False}).astype(bool)
    except (ValueError, TypeError) as exc:
        raise StoreError(f"run {directory}: {meta['file']} column has bad values ({exc})") from None
    check_columns(name, df)
    return df


def load_tables(directory: Path) -> tuple[dict[str, pd.DataFrame], dict]:
    """Read back (tables, env) written by save_tables; StoreError on anything missing, corrupt or mismatched."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise StoreError(f"no saved run at {directory}")
    if not path.is_file():
        raise StoreError(f"{directory} holds no {MANIFEST}: not a saved run")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f"{path} is not a run manifest (format is not '{FORMAT}')")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has schema version {version}, this harness reads {SCHEMA_VERSION}; re-run it")
    try:
        metas = {
            str(n): {
                "file": str(m["file"]),
                "columns": list(m["columns"]),
                "kinds": dict(m["kinds"]),
                "rows": int(m["rows"]),
            }
            for n, m in manifest["tables"].items()
        }
        env = dict(manifest.get("env") or {})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"{path} is malformed ({type(exc).__name__}: {exc})") from None
    return {name: _read_table(directory, name, meta) for name, meta in metas.items()}, env
