"""How the report writes a figure, a size, a ratio and a table: '—' wherever a
value was not measured, so every section shows missing data the same way."""

from __future__ import annotations

import numpy as np
import pandas as pd


def missing(v) -> bool:
    return v is None or (isinstance(v, (float, np.floating)) and np.isnan(v)) or v is pd.NA


def num(v, spec: str = ".3g") -> str:
    """A figure for a table cell: '—' when absent, '0' when exactly zero."""
    return "—" if missing(v) else ("0" if v == 0 else format(float(v), spec))


def human_bytes(v) -> str:
    if missing(v):
        return "—"
    v = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024


def ratio(a, b, spec: str = ".2f") -> str:
    return "—" if missing(a) or missing(b) or not b else f"{format(float(a) / float(b), spec)}x"


def md_table(df: pd.DataFrame) -> str:
    """GitHub-flavoured table with pipes escaped and numbers left exactly as formatted."""
    cells = df.astype(object).map(lambda v: "—" if missing(v) else str(v).replace("|", "\\|").replace("\n", " "))
    return cells.to_markdown(index=False, disable_numparse=True)
