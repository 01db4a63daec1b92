"""Where a run writes by default: a folder of its own, `reports/runs/<YYYYmmdd-HHMMSS>/`, and
`reports/latest`, a symlink to the newest, so that no run replaces another's report (a `pytest -k`
run after the main job, say). `python -m harness report reports/latest/verification_tables` and the
like read the newest run through it. The newest `KEEP_RUNS` run folders are kept; an older one is
removed only with a line saying so. A `reports/latest/` folder written before runs had folders of
their own is moved into `reports/runs/` (under the time it was last written), not replaced.

Only the default report goes here: `--report PATH` writes exactly PATH (harness.session).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import time
from pathlib import Path

RUNS = Path("reports/runs")
LATEST = Path("reports/latest")
KEEP_RUNS = 10
_STAMP = "%Y%m%d-%H%M%S"
_RUN_NAME = re.compile(r"(\d{8}-\d{6})(?:-(\d+))?")


def _free_name(runs: Path, stamp: str) -> Path:
    """runs/<stamp>, or runs/<stamp>-2, -3 ... where a run of the same second has it."""
    names = (runs / (stamp if n == 1 else f"{stamp}-{n}") for n in itertools.count(1))
    return next(folder for folder in names if not os.path.lexists(folder))


def new_run_folder(runs: Path = RUNS) -> tuple[Path, list[Path]]:
    """A new, empty run folder, and the folders this call made (to remove again if the run's write fails)."""
    made = [p for p in (runs, *runs.parents) if not p.exists()]
    runs.mkdir(parents=True, exist_ok=True)
    while True:
        folder = _free_name(runs, time.strftime(_STAMP))
        try:
            folder.mkdir()  # fails if another run took the name meanwhile
        except FileExistsError:
            continue
        return folder, [folder, *made]


def _run_folders(runs: Path) -> list[Path]:
    """The run folders in `runs`, oldest first (other entries are not the harness's: left alone)."""
    found = []
    for entry in runs.iterdir() if runs.is_dir() else ():
        name = _RUN_NAME.fullmatch(entry.name)
        if name and entry.is_dir() and not entry.is_symlink():
            found.append(((name[1], int(name[2] or 1)), entry))
    return [entry for _, entry in sorted(found)]


def publish(folder: Path, runs: Path = RUNS, latest: Path = LATEST, keep: int = KEEP_RUNS) -> list[str]:
    """Point `latest` at the run `folder` just written and keep the newest `keep` runs; the lines
    that say what was moved or removed, and where `latest` points."""
    said = []
    if latest.is_dir() and not latest.is_symlink():  # written before runs had folders of their own
        earlier = _free_name(runs, time.strftime(_STAMP, time.localtime(latest.stat().st_mtime)))
        os.rename(latest, earlier)
        said.append(f"moved the earlier {latest}/ to {earlier}/")
    link = latest.with_name(f".{latest.name}-{os.getpid()}")
    if os.path.lexists(link):
        link.unlink()
    os.symlink(os.path.relpath(folder, latest.parent), link)
    os.replace(link, latest)  # atomic: `latest` always names a complete run
    said.append(f"{latest} -> {folder}")
    older = [f for f in _run_folders(runs) if f != folder]
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old)
        said.append(f"removed {old} (the newest {keep} runs are kept)")
    return said
