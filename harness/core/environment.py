"""The facts about the machine a run records, and the machine kind baselines are kept per.

Losses and parameter diffs are bitwise repeatable only on the same numeric kernels: ATen, oneDNN
and MKL choose vectorised kernels by CPU capability (AVX2, AVX512, ...), and CUDA by GPU model.
So baselines are kept one file per machine kind (`machine_kind`), as torchtitan keeps its loss
assets per GPU kind; `harness.gate.baseline` picks the file of the kind a run is on.
"""

from __future__ import annotations

import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path


def kernel_env(backend: str) -> dict:
    """The keys that choose the numeric kernels (all recorded by `environment`)."""
    import torch  # here, not at the top: the pytest plugin imports this module, and a usage error needs no torch

    cuda = backend == "nccl"
    return {
        "torch": torch.__version__,
        "device": "cuda" if cuda else "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu_model(),
        **({"gpu": torch.cuda.get_device_name()} if cuda else {}),
    }


def environment(backend: str) -> dict:
    """Everything a run records about where it ran (the report's environment table, the baseline's header)."""
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        **kernel_env(backend),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": backend,
        "cuda": torch.version.cuda or "",
        "git_commit": commit or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": _command(),
    }


def machine_kind(env: dict) -> str:
    """'cpu-avx512-torch2.13.0_cpu', 'cuda-nvidia_h100_80gb_hbm3-torch2.13.0': the file name a
    baseline of this kind is saved under (device, CPU capability or GPU model, torch version)."""
    device = str(env.get("device", "cpu"))
    chip = env.get("gpu") if device == "cuda" else env.get("cpu_capability")
    parts = (device, str(chip or "unknown"), f"torch{env.get('torch', 'unknown')}")
    return "-".join(re.sub(r"[^a-z0-9.]+", "_", p.lower()).strip("_") for p in parts)


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


def command_line(program: str, args) -> str:
    """``program`` and ``args`` as a shell line that runs them again (each arg quoted as needed)."""
    return " ".join([program, shlex.join(map(str, args))]).strip()


def _command() -> str:
    """This process's own command line: the CLI's; an entry that knows better (the pytest plugin, whose
    xdist workers' argv is execnet's ``-c``) gives its own to the Session instead."""
    argv = list(sys.argv) or [""]
    if argv[0].endswith("__main__.py"):
        argv[0] = "python -m harness"
    elif argv[0].endswith("pytest"):
        argv[0] = "pytest"
    return command_line(argv[0], argv[1:])
