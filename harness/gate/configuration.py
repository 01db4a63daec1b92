"""The configuration a run was made with, as the gate needs it: what a baseline records beside its
figures, and how two configurations differ.

Scenario ids name the implementation, model, world size, data mode, optimizer, feature and seed, but
not the learning rate, the number of steps or the global batch: two runs whose ids match may still
have trained differently. So a baseline records the configuration of the run it was saved from,
and the gate compares like with like:

    SELECTION  impls, models, world_sizes, data_modes, optimizers, features, seeds: part of the ids,
               so a difference only changes which scenarios the two runs have in common, and those
               are compared
    SETTINGS   lr, steps, global_batch, backend: not part of the ids; a difference makes the figures
               it changes (AFFECTS) incomparable in every scenario, and the gate says "configuration
               differs" instead of calling the change a regression. The learning rate changes what
               a run computes (losses, parameter diffs), not what it holds or sends; the steps, the
               global batch and the backend change what is measured, so they affect every field

The configuration is read from the run's own tables (the scenarios it ran, those it compares with
included, the reference's aside) and its environment (the backend), so a baseline saved from a
run, a stored run given to `compare` and the run being gated all record it the same way. A field a
run did not record (tables stored before it was) is None: unknown, and the gate says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.core.scenario import REFERENCE_IMPL
from harness.gate.tolerance import FIELDS as GATE_FIELDS

SELECTION = {
    "impls": "impl",
    "models": "model",
    "world_sizes": "world_size",
    "data_modes": "data_mode",
    "optimizers": "optimizer",
    "features": "feature",
    "seeds": "seed",
}  # field -> scenarios column
SETTINGS = ("lr", "steps", "global_batch", "backend")  # the first three are scenarios columns, the backend is in env
FIELDS = (*SELECTION, *SETTINGS)
AFFECTS: dict[str, tuple[str, ...]] = {
    "lr": ("loss", "max_diff"),
    "steps": tuple(GATE_FIELDS),
    "global_batch": tuple(GATE_FIELDS),
    "backend": tuple(GATE_FIELDS),
}


def _plain(value):
    """A JSON value: numpy scalars as Python ints and floats."""
    return value.item() if hasattr(value, "item") else value


def configuration_of(tables: dict, env: dict | None = None) -> dict:
    """field -> value for every FIELD: a sorted list for a SELECTION field, one value for a setting
    (a sorted list where the run mixed several), None where the run did not record it."""
    scen = tables.get("scenarios")
    scen = scen if isinstance(scen, pd.DataFrame) else pd.DataFrame()
    if "impl" in scen:
        scen = scen[scen["impl"] != REFERENCE_IMPL]
    if "feature" in scen:  # a run stored before features existed trained the plain step
        scen = scen.assign(feature=scen["feature"].fillna("").replace("", "plain"))
    elif len(scen):
        scen = scen.assign(feature="plain")
    out: dict = {}
    for field, column in SELECTION.items():
        out[field] = sorted({_plain(v) for v in scen[column].dropna()}) if column in scen and len(scen) else None
    for field in ("lr", "steps", "global_batch"):
        values = sorted({_plain(v) for v in scen[field].dropna()}) if field in scen and len(scen) else []
        out[field] = None if not values else values[0] if len(values) == 1 else values
    out["backend"] = (env or {}).get("backend")
    return out


def show(value) -> str:
    """'0.01', '1,2,4,8', 'not recorded'."""
    if value is None:
        return "not recorded"
    if isinstance(value, list):
        return ",".join(show(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Difference:
    field: str
    baseline: object
    current: object

    @property
    def setting(self) -> bool:
        """Whether the two runs trained differently under the same ids (a SETTINGS field)."""
        return self.field in SETTINGS

    def __str__(self) -> str:
        return f"{self.field} {show(self.baseline)} -> {show(self.current)}"


def differences(baseline: dict, current: dict) -> tuple[list[Difference], list[str]]:
    """(the fields recorded on both sides that differ, the fields either side did not record)."""
    differ, unknown = [], []
    for field in FIELDS:
        b, c = baseline.get(field), current.get(field)
        if b is None or c is None:
            unknown.append(field)
        elif b != c:
            differ.append(Difference(field, b, c))
    return differ, unknown


def affected(differ: list[Difference]) -> dict[str, list[Difference]]:
    """gate field -> the setting differences that make it incomparable (fields no difference touches left out)."""
    out: dict[str, list[Difference]] = {}
    for d in differ:
        for field in AFFECTS.get(d.field, ()):
            out.setdefault(field, []).append(d)
    return {f: out[f] for f in GATE_FIELDS if f in out}
