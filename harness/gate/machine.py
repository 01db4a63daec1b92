"""Whether a run's machine matches its baseline's: the environment keys that differ, and whether
the numeric kernels may differ.

Numeric kernels (NUMERIC_ENV: torch version, device, ``cpu_capability`` such as AVX2 or AVX512,
the CPU's name, the GPU): ATen, oneDNN and MKL pick different vectorised kernels and blockings, so
losses and parameter diffs of the same code differ in the last bits between machines
(reports/measured_behaviour.md#numerics-across-machines). Unless
every one of these keys is recorded alike on both sides, ``loss`` and ``max_diff`` are SKIP for
every scenario, with the reason; memory, traffic and the rest are still gated. The CPU counts by
its name without the family and model numbers (``cpu_name``): two generations under one name and
capability run the same kernels (two generations of one name and capability agreed bitwise:
reports/measured_behaviour.md#numerics-across-machines), and MKL chooses its code path by vendor, which
the name carries.
"""

from __future__ import annotations

import re

from harness.gate.baseline import Baseline, jsonable_env

# Environment keys expected to differ between any two runs: never warned about.
VOLATILE_ENV = {"date", "command", "git_commit", "hostname", "duration_s", "time"}
# Environment keys that choose the numeric kernels: losses and diffs are only comparable when all match.
NUMERIC_ENV = ("torch", "device", "cpu_capability", "cpu", "gpu")
# Fields whose values depend on the CPU's kernel set (see the module docstring).
KERNEL_DEPENDENT = ("loss", "max_diff")


def env_warnings(env: dict | None, baseline: Baseline) -> list[tuple[str, str]]:
    """(key, sentence) for every non-volatile environment key that differs from the baseline's."""
    if env is None:
        return []
    cur, base = jsonable_env(env), baseline.env
    keys = sorted((set(cur) | set(base)) - VOLATILE_ENV)
    return [
        (
            k,
            f"environment differs from baseline '{baseline.name}': {k} was {base.get(k)!r}, now "
            f"{cur.get(k)!r}; figures may move for this reason",
        )
        for k in keys
        if cur.get(k) != base.get(k)
    ]


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
    cur = jsonable_env(env)
    differ = [k for k in NUMERIC_ENV if _kernel_fact(cur, k) != _kernel_fact(baseline.env, k)]
    if not differ:
        return ""
    if baseline.wanted_kind:
        return (
            f"baseline '{baseline.name}' has no file for this machine kind ({baseline.wanted_kind}); memory "
            f"and traffic were gated against {baseline.path.name}, losses and parameter diffs were NOT gated "
            f"(their last bits depend on the kernels; save one with --save-baseline {baseline.name})"
        )
    said = "; ".join(
        f"{k} {baseline.env.get(k, 'not recorded')!r} there, {cur.get(k, 'not recorded')!r} here" for k in differ
    )
    return (
        f"baseline '{baseline.name}' may have run on other numeric kernels ({said}): losses and "
        f"parameter diffs differ in the last bits between kernel sets, so they are not compared "
        f"(re-save the baseline on this kind of machine to gate them)"
    )
