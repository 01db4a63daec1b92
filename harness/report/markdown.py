"""Markdown verification report (plus SVG plots) rendered from a run's tables, written atomically.

Section order: title + overall line, verdict summary, failures (with divergence location), known
deviations, skipped checks (verdicts.py), the models' noise floors (noise.py), results per world size
(with loss / diff-vs-step tables and plots; results.py), memory, communication (resources.py), the sections other packages register
(sections.py; the per-sample gradient norms, only when the run has them), environment. Missing or
empty tables render as "not measured".
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pandas as pd

from harness.report.drawing import Plots
from harness.report.formatting import md_table
from harness.report.groups import cells_of, table_or_empty
from harness.report.noise import noise_section
from harness.report.resources import comm_section, memory_section
from harness.report.results import group_sections
from harness.report.sections import section_lines
from harness.report.verdicts import overall_line, verdict_sections
from harness.tables.store import swap_into_place, writing

ENV_ORDER = ["torch", "backend", "device", "seed", "git_commit", "date", "command"]


def _env_section(env: dict) -> list[str]:
    if not env:
        return ["## Environment", "", "_Environment: not recorded._", ""]
    keys = [k for k in ENV_ORDER if k in env] + sorted(k for k in env if k not in ENV_ORDER)
    vals = [" ".join(map(str, env[k])) if isinstance(env[k], (list, tuple)) else str(env[k]) for k in keys]
    return ["## Environment", "", md_table(pd.DataFrame({"key": keys, "value": vals})), ""]


def render(tables: dict, env: dict, title: str, plots_dir: Path | None, rel: str) -> str:
    """The markdown text; plots are written into `plots_dir` and linked as `rel/<file>` (None: none drawn)."""
    out = [f"# {title}", "", overall_line(table_or_empty(tables, "verdicts"), cells_of(tables)), ""]
    with Plots(plots_dir, rel) as drawn:  # its workers stopped however the rendering ends
        out += verdict_sections(tables) + noise_section(tables) + group_sections(tables, drawn)
        out += memory_section(tables, drawn) + comm_section(tables) + section_lines(tables)
        out += _env_section(env or {})
        return drawn.finish("\n".join(out).rstrip() + "\n")


def write_report(
    tables: dict, env: dict, path: Path, *, title: str = "FSDP equivalence verification", plots: bool = True
) -> Path:
    """Write `path` (markdown) and `<stem>_plots/` beside it, atomically; returns `path`. A write
    that fails raises harness.tables.store.OutputError (one line) and leaves the earlier report in place.
    `plots` False: the plots folder is left empty (--no-plots)."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.stem}.tmp-"))
        try:
            swap_into_place(stage_report(tables, env, path, tmp, title=title, plots=plots))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def stage_report(
    tables: dict, env: dict, path: Path, tmp: Path, *, title: str = "FSDP equivalence verification", plots: bool = True
) -> list[tuple[Path, Path]]:
    """Render the report and its plots into `tmp`; the (staged, final) pairs for `swap_into_place`. `plots`
    False (--no-plots): none drawn, and the plots folder is staged empty, so that no earlier run's plots stay
    beside this report."""
    path = Path(path)
    plots_name = f"{path.stem}_plots"
    (tmp / plots_name).mkdir()
    drawn = tmp / plots_name if plots else None
    (tmp / path.name).write_text(render(tables, env, title, drawn, plots_name), encoding="utf-8")
    return [(tmp / plots_name, path.parent / plots_name), (tmp / path.name, path)]
