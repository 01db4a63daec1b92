"""Runs a scenario matrix: groups scenarios by world, reuses each world for its whole group."""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from .checks import run_checks, verdict_table
from .policy import Bounds
from .scenario import Scenario
from .tables import build_tables
from .verdict import Verdict
from .world import WorldError, WorldPool

TASK = "harness.train:run_scenario"


@dataclass
class RunResult:
    scenarios: list[Scenario]
    tables: dict[str, pd.DataFrame]
    verdicts: list[Verdict]
    env: dict
    wall_s: float
    worlds_started: int = 0
    records: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.passed]


def environment(backend: str) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "backend": backend, "device": "cuda" if backend == "nccl" else "cpu",
            "cuda": torch.version.cuda or "", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_model(), **({"gpu": torch.cuda.get_device_name()} if backend == "nccl" else {}),
            "git_commit": commit or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": _command()}


def cpu_model() -> str:
    """The CPU's name with its family and model numbers (a virtual host may just say 'AMD EPYC')."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name") or platform.processor() or platform.machine()
    return f"{name} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def _command() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "python -m harness"
    elif argv and argv[0].endswith(("pytest", "pytest/__main__.py")):
        argv[0] = "pytest"
    return " ".join(argv)


def execute(scenarios: list[Scenario], *, snapshot_dir: Path, pool: WorldPool,
            timeout_s: float = 300.0, progress: Callable[[int, int, Scenario, float], None] | None = None) -> dict:
    """scenario id -> {"ranks": [record per rank]} or {"error": message}. Worlds in ascending size."""
    results: dict[str, dict] = {}
    order = sorted(scenarios, key=lambda s: (s.backend, s.world_size))
    for i, sc in enumerate(order):
        t0 = time.perf_counter()
        payload = {"scenario": dataclasses.asdict(sc), "snapshot_dir": str(snapshot_dir)}
        try:
            world = pool.get(sc.world_size, sc.backend)
            results[sc.id] = {"ranks": world.run(TASK, payload, timeout_s=timeout_s)}
        except WorldError as e:
            results[sc.id] = {"error": str(e)}
        if progress is not None:
            progress(i + 1, len(order), sc, time.perf_counter() - t0)
    return results


def apply_gate(result: RunResult, baseline, tolerances: dict | None) -> list[Verdict]:
    """Compare a run with a loaded baseline; gate verdicts join the run's verdicts (and its table)."""
    from .baseline import compare
    gate = compare(result.tables, baseline, tolerances, env=result.env, allow_missing=True)
    result.verdicts.extend(gate)
    result.tables["verdicts"] = verdict_table(result.verdicts)
    return gate


def add_per_sample(result: RunResult, world_sizes, models=("mlp",)) -> None:
    """Per-sample gradient norms (both data modes) joined to a run: their tables and verdicts."""
    from .per_sample_run import run_per_sample
    tables, verdicts = run_per_sample(models=tuple(models), world_sizes=tuple(world_sizes))
    result.tables.update(tables)
    result.verdicts.extend(verdicts)
    result.tables["verdicts"] = verdict_table(result.verdicts)


def run_matrix(scenarios: list[Scenario], *, pool: WorldPool | None = None, timeout_s: float = 300.0,
               bounds: Bounds = Bounds(), progress=None, extra_checks=()) -> RunResult:
    t0 = time.perf_counter()
    own_pool = pool is None
    pool = pool or WorldPool(timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="fsdp-harness-") as tmp:
        try:
            records = execute(scenarios, snapshot_dir=Path(tmp), pool=pool, timeout_s=timeout_s, progress=progress)
        finally:
            if own_pool:
                pool.close()
        tables = build_tables(scenarios, records)
    verdicts = run_checks(tables, bounds, extra=extra_checks)
    tables["verdicts"] = verdict_table(verdicts)
    backend = scenarios[0].backend if scenarios else "gloo"
    return RunResult(scenarios, tables, verdicts, environment(backend), time.perf_counter() - t0,
                     getattr(pool, "worlds_started", 0), records)
