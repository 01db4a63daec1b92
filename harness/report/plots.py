"""SVG plots for the verification report: loss curves, |param diff| vs step, memory vs world size.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend state), so it is
safe in worker processes and headless CI. `*_figure` builds a Figure from tidy frames (inspectable
in tests); `plot_*` builds and saves it as SVG at the given path (its name ends in SUFFIX).

SVG rather than PNG: a report of the main job holds dozens of plots, and a vector file with its text kept as text
skips the rasterising and the compression, most of a raster plot's cost (reports/performance.md, "The report's
plots"); the files are smaller and scale in any viewer. The same figure gives the same bytes (no date, fixed ids).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # matplotlib loads at the first figure, not in a run with no report (reports/performance.md#imports)
    from matplotlib.figure import Figure

MARKERS = "osD^v<>ph*"
DPI = 110
SUFFIX = ".svg"  # a plot's file name ends so
# text as text in the viewer's font (matplotlib writes the family list, ending in sans-serif), ids from a fixed
# salt instead of a random one: the same figure gives the same file, in a worker or here
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "fsdp-harness"}


def _ticker():
    import matplotlib.ticker

    return matplotlib.ticker


def _figure(width: float = 7.0, height: float = 4.2) -> tuple[Figure, object]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(left=0.14, right=0.97, top=0.92, bottom=0.12)  # fixed: layout engines cost seconds
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _save(fig: Figure, path: Path) -> Path:
    import matplotlib

    path = Path(path)
    with matplotlib.rc_context(_SVG_RC):
        fig.savefig(path, format="svg", metadata={"Date": None})
    return path


def _series(steps: pd.DataFrame, column: str) -> dict[int, pd.DataFrame]:
    """world size -> rows (step, column) sorted by step."""
    return {int(ws): g.sort_values("step")[["step", column]] for ws, g in steps.groupby("world_size", sort=True)}


def loss_figure(steps: pd.DataFrame, reference: pd.DataFrame | None, title: str) -> Figure:
    """Loss per step, one line per world size (shrinking markers so exact overlaps stay visible)."""
    fig, ax = _figure()
    series = _series(steps, "loss")
    for i, (ws, g) in enumerate(series.items()):
        ax.plot(
            g["step"],
            g["loss"],
            marker=MARKERS[i % len(MARKERS)],
            markersize=9 - 1.5 * i,
            linewidth=2.2 - 0.4 * min(i, 4),
            alpha=0.85,
            label=f"W={ws}",
        )
    if reference is not None and len(reference):
        r = reference.sort_values("step")
        ax.plot(r["step"], r["loss"], "k--", linewidth=1, label="reference (1 process)")
    ax.set(title=title, xlabel="step", ylabel="global loss")
    ax.xaxis.set_major_locator(_ticker().MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def zero_floor(values, bounds=()) -> float:
    """Where exact zeros are drawn on the log axis: two decades below the smallest positive figure."""
    v = np.asarray([*np.asarray(values, dtype=float).ravel(), *bounds], dtype=float)
    positive = v[np.isfinite(v) & (v > 0)]
    return float(10.0 ** (np.floor(np.log10(positive.min() if len(positive) else 1e-8)) - 2))


def diff_figure(
    steps: pd.DataFrame, title: str, *, column: str = "max_diff_ref", bounds: dict[str, float] | None = None
) -> Figure:
    """max |param diff| per step on a log scale; exact zeros are drawn on a floor line labelled 'exact'."""
    fig, ax = _figure()
    floor = zero_floor(steps[column], [b for b in (bounds or {}).values() if b and b > 0])
    for i, (ws, g) in enumerate(_series(steps, column).items()):
        y = g[column].to_numpy(dtype=float)
        ax.plot(
            g["step"],
            np.where(y > 0, y, floor),
            marker=MARKERS[i % len(MARKERS)],
            markersize=9 - 1.5 * i,
            alpha=0.85,
            label=f"W={ws}",
        )
    ax.axhline(floor, color="grey", linewidth=0.8, linestyle=":")
    for label, b in (bounds or {}).items():
        if b and b > 0:
            ax.axhline(b, color="red", linewidth=1, linestyle="--", label=f"bound {label} = {b:.0e}")
    top = max(
        [
            floor * 30,
            *[float(v) for v in steps[column] if np.isfinite(v)],
            *[b for b in (bounds or {}).values() if b and b > 0],
        ]
    )
    ax.set_ylim(floor / 3, top * 3)  # a range before the log scale: all-exact data has none of its own
    ax.set_yscale("log")

    def tick(v: float, _pos: int) -> str:
        return "0 (exact)" if np.isclose(v, floor, rtol=1e-6, atol=0.0) else f"{v:.0e}"

    ax.yaxis.set_major_formatter(_ticker().FuncFormatter(tick))
    ax.yaxis.set_minor_locator(_ticker().NullLocator())
    ax.set_yticks(sorted({floor, *[t for t in ax.get_yticks() if t > floor * 5]}))
    ax.set_ylim(bottom=floor / 3)
    ax.set(title=title, xlabel="step", ylabel=f"max |param diff| ({column.removeprefix('max_diff_')})")
    ax.xaxis.set_major_locator(_ticker().MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="major")
    ax.legend()
    return fig


def memory_figure(per_ws: pd.DataFrame, title: str) -> Figure:
    """Per-rank state and peak bytes vs world size with the ideal 1/W line from the smallest world.

    `per_ws` has columns world_size, state_bytes, peak_bytes (one row per world size).
    """
    fig, ax = _figure()
    d = per_ws.sort_values("world_size")
    ws = d["world_size"].to_numpy(dtype=float)
    top = float(np.nanmax(d[[c for c in ("state_bytes", "peak_bytes") if c in d]].to_numpy(dtype=float), initial=1.0))
    power = int(min(max(np.log2(max(top, 1.0)) // 10, 0), 3))  # B, KiB, MiB or GiB by the largest figure
    unit, mib = ("B", "KiB", "MiB", "GiB")[power], 1024.0**power
    for col, marker, label in (("state_bytes", "o", "state (params+grads+optimizer)"), ("peak_bytes", "s", "peak")):
        if col in d and d[col].notna().any():
            ax.plot(ws, d[col] / mib, marker=marker, linewidth=2, label=f"{label}, measured")
    base = d["state_bytes"].dropna() if "state_bytes" in d else pd.Series(dtype=float)
    if len(base):
        w0, s0 = float(d.loc[base.index[0], "world_size"]), float(base.iloc[0])
        grid = np.geomspace(ws.min(), ws.max(), 50) if ws.max() > ws.min() else ws
        ax.plot(grid, s0 * w0 / grid / mib, "k--", linewidth=1, label="ideal state: 1/W")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ws, [str(int(w)) for w in ws])
    ax.set_yscale("log")
    ax.xaxis.set_minor_locator(_ticker().NullLocator())
    ticks = sorted({float(v) for c in ("state_bytes", "peak_bytes") if c in d for v in d[c].dropna() / mib})
    kept: list[float] = []
    for t in ticks:  # labels closer than 15% would overlap on the log axis
        if t > 0 and (not kept or t / kept[-1] >= 1.15):
            kept.append(t)
    ax.set_yticks(kept)
    ax.yaxis.set_minor_locator(_ticker().NullLocator())
    ax.yaxis.set_major_formatter(_ticker().FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    ax.set(title=title, xlabel="world size W (ranks)", ylabel=f"bytes per rank ({unit})")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return fig


def plot_loss(steps: pd.DataFrame, reference: pd.DataFrame | None, title: str, path: Path) -> Path:
    """Loss per step, one line per world size, plus the reference run; saved as SVG."""
    return _save(loss_figure(steps, reference, title), path)


def plot_diff(steps: pd.DataFrame, title: str, path: Path, **kwargs) -> Path:
    """max |param diff| vs step on a log scale (zeros on a floor labelled exact); saved as SVG."""
    return _save(diff_figure(steps, title, **kwargs), path)


def plot_memory(per_ws: pd.DataFrame, title: str, path: Path) -> Path:
    """State and peak bytes per rank vs world size with the ideal 1/W line; saved as SVG."""
    return _save(memory_figure(per_ws, title), path)
