"""Per-rank records -> tidy pandas tables, with the columns `schema.py` defines.

`diff_ref` is against the non-sharded model trained on the full batch; `diff_ws1` against the same
implementation at world size 1 in the same data mode. `params` holds the full, unsharded
parameters under their module paths; `memory` the peak by category during the measured step and
the state held after it; `comm` rank 0's collectives per training step, averaged over the steps.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from harness.core.names import HF_PREFIX
from harness.core.scenario import REFERENCE_IMPL, Scenario, ckpt_step
from harness.measure.ideals import STATE
from harness.tables.restored_state import compare_files
from harness.tables.rows import params_moved, rows_apart
from harness.tables.schema import columns
from harness.train.checkpointing import RESTORED_STATE, SAVED_STATE
from harness.train.models import get_model_spec
from harness.train.params_file import load_params
from harness.train.records import read_gradient_digest
from harness.train.user_models import WEIGHTED_MEAN, ModelError, check_model


def scenario_fields(sc: Scenario) -> dict:
    """What every table's row of scenario `sc` says of it: its id and the fields that make it."""
    return {
        "scenario": sc.id,
        "impl": sc.impl,
        "model": sc.model,
        "world_size": sc.world_size,
        "data_mode": sc.data_mode,
        "optimizer": sc.optimizer,
        "seed": sc.seed,
        "feature": sc.feature,
        "resume_from": sc.resume_from,
        "micro_batches": sc.micro_batches,
        "reverse_micro": sc.reverse_micro,
        "nudge": sc.nudge,
    }


class _Snapshots:
    """Loads rank 0's per-step full-parameter files lazily, one scenario at a time."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs, self._cache = dirs, {}

    def grads(self, scenario_id: str, step: int) -> torch.Tensor | None:
        """The sorted gradient values the ranks' optimizers applied at that step (replicated data only; None where
        none were written: harness.train.records)."""
        d = self.dirs.get(scenario_id)
        return None if d is None else read_gradient_digest(Path(d), step)

    def get(self, scenario_id: str, step: int) -> dict[str, torch.Tensor] | None:
        d = self.dirs.get(scenario_id)
        if d is None:
            return None
        key = (scenario_id, step)
        if key not in self._cache:
            path = Path(d) / f"step{step}.pt"
            self._cache[key] = load_params(path) if path.exists() else None
        return self._cache[key]


def _grad_diff(x: torch.Tensor | None, y: torch.Tensor | None) -> float:
    """Max |difference| between two sorted gradient digests (0.0: bitwise the same multiset of
    values); inf when they hold different numbers of non-zero values; NaN when one is missing."""
    if x is None or y is None:
        return math.nan
    if x.shape != y.shape:
        return math.inf
    return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0


def param_diffs(cur: dict, other: dict | None) -> dict[str, float]:
    """parameter -> max |cur - other| over its elements, in float64 (0.0 for an empty one); inf where `other` lacks
    it or shapes differ; NaN where `cur`'s own values are not all finite (or a difference is NaN). Every parameter
    in one pass over the flat values: a parameter at a time, the tensor calls cost more than the arithmetic."""
    if other is None:
        return {}
    alike = [n for n, t in cur.items() if other.get(n) is not None and other[n].shape == t.shape]
    found = dict(zip(alike, _segment_max(cur, other, alike))) if alike else {}
    return {name: found.get(name, math.inf) for name in cur}


def _flat(tensors: dict, names: list[str]) -> np.ndarray:
    return torch.cat([tensors[n].reshape(-1) for n in names]).double().numpy()


def _segment_max(cur: dict, other: dict, names: list[str]) -> list[float]:
    a = _flat(cur, names)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as in torch
        d = np.abs(a - _flat(other, names))
    sizes = np.array([cur[n].numel() for n in names])
    starts = np.cumsum(sizes) - sizes
    out = np.zeros(len(names))
    full = sizes > 0  # reduceat's segment i ends where the next non-empty one starts
    if full.any():
        out[full] = np.maximum.reduceat(d, starts[full])  # NaN wins, as in torch's max
        out[full] = np.where(np.logical_and.reduceat(np.isfinite(a), starts[full]), out[full], np.nan)
    return out.tolist()


def _travel(cur: dict, before: dict | None) -> dict[str, float]:
    """parameter -> ||its step||_F: how far one step of a plain-model run moved it (the measured reach of a
    user's optimizer, harness/checks/noise_floor.py); {} without the step before."""
    if before is None:
        return {}
    return {
        name: float((t.double() - before[name].double()).norm())
        for name, t in cur.items()
        if name in before and before[name].shape == t.shape
    }


@functools.lru_cache(maxsize=64)
def weighted_loss(model: str, global_batch: int, seed: int, steps: int) -> bool:
    """Whether the user's model `model` (package.module:factory) has a loss that is a mean weighted by a count each
    sample carries (a token mean) over the batches of steps 1..`steps`, as the preflight measures it
    (harness/train/user_models.py check_model): the scenarios table's weighted_loss, by which its split runs are
    held to the ranks' own means. False for the harness's own models (each a mean over the samples, held so by the
    unit tests) and for a model that cannot be measured (the preflight refuses it)."""
    if ":" not in model or model.startswith(HF_PREFIX):
        return False
    try:
        return check_model(get_model_spec(model), global_batch, seed, steps) == WEIGHTED_MEAN
    except (ModelError, ValueError):
        return False


TABLES = ("steps", "params", "scenarios", "memory", "comm", "coverage", "gathered", "rank_diffs", "rows_trained")


def build_tables(scenarios: list[Scenario], results: dict[str, dict]) -> dict[str, pd.DataFrame]:
    """results: scenario id -> {"ranks": [per-rank record...]} or {"error": str}."""
    builder = TableBuilder(scenarios)
    for sid, res in results.items():
        builder.add(sid, res)
    return builder.finish()


class TableBuilder:
    """The tables, built a scenario at a time as the records come in (`add`): a scenario's rows are made once its
    record and those of every run it is compared with (`compared_with`) are in, on a thread of their own where
    `background` (the parent has cores to spare while the ranks train: a rank waits on its collectives, and a world
    of 1 rank leaves the other cores idle), here at `add` otherwise. `finish` makes the rows not made yet (a run a
    scenario is compared with that never came: its columns NaN, as in a matrix without it) and gives the tables,
    every scenario's rows in the order of `scenarios`, whatever order the records came in."""

    def __init__(self, scenarios: list[Scenario], background: bool = False):
        self.scenarios = list(scenarios)
        self.by_id = {s.id: s for s in self.scenarios}
        self.results: dict[str, dict] = {}
        self.snaps = _Snapshots({})
        self.made: dict[str, dict[str, list[dict]]] = {}  # scenario id -> its rows by table
        # scenario id -> the runs of this matrix its rows read (its own included)
        self._needs = {s.id: {d for d in compared_with(s) if d in self.by_id} | {s.id} for s in self.scenarios}
        self._readers: dict[str, list[Scenario]] = {}  # run id -> the scenarios whose rows read it
        for s in self.scenarios:
            for run in self._needs[s.id]:
                self._readers.setdefault(run, []).append(s)
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._stopped = False
        self._background = background

    def add(self, sid: str, record: dict) -> None:
        """Scenario `sid`'s record (harness.execute.executor.execute's): rows made for every scenario it completes.
        The thread starts with the first record, not before: the first world's start, which may start the worlds'
        forkserver, comes first, and the server is forked only from a process with one thread
        (harness.execute.forked_server)."""
        if self._background and self._thread is None and not self._stopped:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._work, name="tables", daemon=True)
            self._thread.start()
        if self._queue is not None:
            self._queue.put((sid, record))
        else:
            self._take(sid, record)

    def _take(self, sid: str, record: dict) -> None:
        self.results[sid] = record
        if "ranks" in record:
            self.snaps.dirs[sid] = record["ranks"][0]["snapshot_dir"]
        for sc in self._readers.get(sid, ()):  # only a scenario that reads this run can be complete now
            if sc.id not in self.made and self._needs[sc.id] <= self.results.keys():
                self._make(sc)

    def _make(self, sc: Scenario) -> None:
        self.made[sc.id] = _scenario_rows(sc, self.results, self.snaps, self.by_id)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._failed is None and not self._stopped:
                try:
                    self._take(*item)
                except BaseException as e:  # noqa: BLE001 (raised again by finish, in the caller's thread)
                    self._failed = e

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stops the thread without making the rows of the records still queued (a run interrupted); idempotent."""
        self._stopped = True
        self._join()

    def finish(self) -> dict[str, pd.DataFrame]:
        """The tables: the records queued taken, the rows not made yet made."""
        self._join()
        if self._failed is not None:
            raise self._failed
        for sc in self.scenarios:
            if sc.id not in self.made:
                self._make(sc)
        rows = {name: [r for sc in self.scenarios for r in self.made[sc.id][name]] for name in TABLES}
        return {name: pd.DataFrame(r, columns=columns(name)) for name, r in rows.items()}


def compared_with(sc: Scenario) -> list[str]:
    """The ids of the runs whose records and snapshots `sc`'s rows read: its dependencies, the rank-order probe and
    the factor twin it is held to."""
    runs = [*sc.dependencies(), sc.rank_order_probe(), sc.factor_twin()]
    if sc.impl != REFERENCE_IMPL:
        runs.append(sc.ws1())
    return list(dict.fromkeys(r.id for r in runs if r is not None))


def _scenario_rows(sc: Scenario, results: dict[str, dict], snaps: _Snapshots, by_id: dict) -> dict[str, list[dict]]:
    """Scenario `sc`'s rows of every table, from its record and those of the runs it is compared with."""
    rows: dict[str, list[dict]] = {name: [] for name in TABLES}
    res = results.get(sc.id, {"error": "not run"})
    base = scenario_fields(sc)
    if "ranks" not in res:
        status, why = ("unsupported", res["unsupported"]) if "unsupported" in res else ("error", res["error"])
        status, why = model_limit(sc, status, why, results)
        rows["scenarios"].append(
            {**base, **settings(sc), "status": status, "error": why, "failed_rank": res.get("failed_rank")}
        )
        return rows
    r0 = res["ranks"][0]
    ref_id = sc.reference().id
    ws1_id = sc.ws1().id if sc.impl != REFERENCE_IMPL else None
    final, compared = {}, math.nan
    for i, rec in enumerate(r0["steps"]):
        k = rec["step"]
        cur = snaps.get(sc.id, k) or {}
        ref = snaps.get(ref_id, k) if ref_id in by_id else None
        if ref is not None and sc.impl != REFERENCE_IMPL:
            rows["coverage"] += _coverage(sc.id, k, cur, ref)
            compared = len(ref)
        ws1 = snaps.get(ws1_id, k) if ws1_id in by_id else None
        d_ref, d_ws1 = param_diffs(cur, ref), param_diffs(cur, ws1)
        probe = sc.rank_order_probe()
        d_probe = param_diffs(cur, snaps.get(probe.id, k)) if probe is not None and probe.id in by_id else {}
        rows["rank_diffs"] += rank_row_diffs(sc.id, k, res["ranks"], cur, ref, ws1, d_ref, d_ws1)
        twin = sc.factor_twin()
        d_twin = param_diffs(cur, snaps.get(twin.id, k)) if twin is not None and twin.id in by_id else {}
        moved = _travel(cur, snaps.get(sc.id, k - 1)) if sc.impl == REFERENCE_IMPL else {}
        for name, t in cur.items():
            rows["params"].append(
                {
                    "scenario": sc.id,
                    "step": k,
                    "param": name,
                    "numel": t.numel(),
                    "diff_ref": d_ref.get(name, math.nan),
                    "diff_ws1": d_ws1.get(name, math.nan),
                    "diff_probe": d_probe.get(name, math.nan),
                    "diff_factor": d_twin.get(name, math.nan),
                    "travel": moved.get(name, math.nan),
                    "sum": float(t.double().sum()),
                }
            )
        wr, mr = _worst(d_ref)
        w1, m1 = _worst(d_ws1)
        wt, mt = _worst(d_twin)
        wp, mp = _worst(d_probe)
        g1 = math.nan
        if ws1_id in by_id and ws1_id != sc.id and sc.data_mode == "replicated":
            g1 = _grad_diff(snaps.grads(sc.id, k), snaps.grads(ws1_id, k))
        rows["steps"].append(
            {
                **base,
                "step": k,
                "loss": rec["loss"],
                "grad_norm": rec["grad_norm"],
                "max_diff_ref": mr,
                "worst_param_ref": wr,
                "max_diff_ws1": m1,
                "worst_param_ws1": w1,
                "grad_diff_ws1": g1,
                "clip_norm": rec.get("clip_norm", math.nan),
                "max_diff_factor": mt,
                "worst_param_factor": wt,
                "max_diff_probe": mp,
                "worst_param_probe": wp,
                "replicas_differ": rec.get("replicas_differ", math.nan),
                "jitter_delays": sum(r["steps"][i].get("jitter_delays", 0) for r in res["ranks"]),
                "jitter_s": sum(r["steps"][i].get("jitter_s", 0.0) for r in res["ranks"]),
                "reduction_ranks": reduction_ranks(res["ranks"], i, r0.get("param_tensors", 0)),
                "reports_differ": reports_differ(res["ranks"], i),
                "eval_loss": rec.get("eval_loss", math.nan),
                "eval_loss_plain": rec.get("eval_loss_plain", math.nan),
                "nonfinite_module": rec.get("nonfinite_module", ""),
            }
        )
        final = {
            "final_loss": rec["loss"],
            "param_sum": sum(float(t.double().sum()) for t in cur.values()),
            "max_diff_ref": mr,
            "max_diff_ws1": m1,
        }
    restore = _restore(sc, snaps, by_id)
    rows_compared = rows_moved = rows_noise = math.nan
    if sc.impl != REFERENCE_IMPL and ref_id in by_id:
        apart, rows_compared, rows_moved, rows_noise = rows_apart(
            sc, snaps, res["ranks"], ref_id, [p for p in sc.noise_probes() if p.id in by_id]
        )
        rows["rows_trained"] += apart
    calm = _calm(sc, snaps, by_id, [rec["step"] for rec in r0["steps"]])
    for rank_rec in res["ranks"]:
        for cat, b in rank_rec["memory"].items():
            rows["memory"].append({"scenario": sc.id, "rank": rank_rec["rank"], "category": cat, "bytes": b})
        rows["gathered"] += [{"scenario": sc.id, "rank": rank_rec["rank"], **g} for g in rank_rec.get("gathered", ())]
    for c in r0["comm"]:
        rows["comm"].append({"scenario": sc.id, **c})
    state = [rr["memory"].get("state_total", math.nan) for rr in res["ranks"]]
    peak = [rr["memory"].get("peak", math.nan) for rr in res["ranks"]]
    rows["scenarios"].append(
        {
            **base,
            **settings(sc),
            "status": "ok",
            "error": "",
            "failed_rank": None,
            **final,
            "sharded": r0.get("sharded", True),
            "sharded_state": r0.get("sharded_state", ",".join(STATE) if r0.get("sharded", True) else ""),
            "engine_clips": bool(r0.get("engine_clips", False)),
            "param_bytes": r0.get("param_bytes", math.nan),
            "trainable_bytes": r0.get("trainable_bytes", math.nan),
            "param_elements": r0.get("param_elements", math.nan),
            "trainable_elements": r0.get("trainable_elements", math.nan),
            "largest_unit_bytes": r0.get("largest_unit_bytes", math.nan),
            "largest_child_bytes": r0.get("largest_child_bytes", math.nan),
            "root_bytes": r0.get("root_bytes", math.nan),
            "row_bytes": r0.get("row_bytes", math.nan),
            "param_tensors": r0.get("param_tensors", math.nan),
            "buffer_bytes": r0.get("buffer_bytes", math.nan),
            "batch_stats": r0.get("batch_stats", ""),
            "weighted_loss": weighted_loss(sc.model, sc.global_batch, sc.seed, sc.steps),
            "params_compared": compared,
            "rows_compared": rows_compared,
            "rows_moved": rows_moved,
            "rows_noise": rows_noise,
            "params_moved": params_moved(sc, snaps),
            **restore,
            **calm,
            "state_bytes": max(state),
            "peak_bytes": max(peak),
            "step_time_s": max(rr["step_time_s"] for rr in res["ranks"]),
        }
    )
    return rows


# what every rank's step record says that must be the same on every rank
REPORTED = ("loss", "clip_norm", "eval_loss")


def reports_differ(ranks: list[dict], i: int) -> str:
    """What a rank's step record says that differs from rank 0's (the loss, the norm its clip_grad_norm
    returned, the eval loss: global figures, the same on every rank), as 'rank:field=value' comma-separated ('' where all
    agree): the tables keep rank 0's records, so a rank that reports a figure of its own shows only here."""
    first = ranks[0].get("steps", [])
    if i >= len(first):
        return ""
    out = []
    for rank in ranks[1:]:
        recs = rank.get("steps", [])
        mine = recs[i] if i < len(recs) else {}
        for field in REPORTED:
            a, b = first[i].get(field, math.nan), mine.get(field, math.nan)
            if not (a == b or (a != a and b != b)):  # bitwise the same, NaN alike
                out.append(f"{rank['rank']}:{field}={b!r}")
    return ",".join(out)


def reduction_ranks(ranks: list[dict], i: int, param_tensors: int) -> str | float:
    """Replicated data: the ranks whose inputs to the step's gradient reductions differ from the rest's
    (every rank computes the same gradient, so a correct one puts the same values in), comma-separated;
    '' where all agree; NaN where not recorded. Reductions of at most one element per parameter tensor
    (a clipping norm from each rank's own shard) are left out. Named: the ranks outside the largest group
    of ranks that agree, or every rank where no group is largest (2 ranks that differ)."""
    seen = []
    for rank in ranks:
        recs = rank.get("steps", [])
        inputs = recs[i].get("reduction_inputs") if i < len(recs) else None
        if inputs is None:
            return math.nan
        seen.append(tuple(tuple(x) for x in inputs if x[1] > param_tensors))
    groups: dict[tuple, list[int]] = {}
    for rank, key in zip((r["rank"] for r in ranks), seen):
        groups.setdefault(key, []).append(rank)
    if len(groups) < 2:
        return ""
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    if sizes[0] == sizes[1]:  # no majority: every rank is in question
        return ",".join(str(r["rank"]) for r in ranks)
    largest = max(groups.values(), key=len)
    return ",".join(str(r) for g in groups.values() if g is not largest for r in g)


MODEL_LIMIT = "model limit:"  # how a failure that is the model's, not an implementation's, begins


def model_limit(sc: Scenario, status: str, error: str, results: dict[str, dict]) -> tuple[str, str]:
    """(status, error) of a failed scenario, told apart from an implementation's failure where the plain
    model fails too. A sharded run that fails as a plain run it is compared with fails (that run's exception
    line raised on one of its ranks) is `unsupported`: the model cannot run that scenario, whoever shards it (a BatchNorm under the bf16
    policy, a 1-sample micro-batch of batch statistics). A failed plain run keeps its failure (no yardstick
    is no pass) but says first that no implementation is involved."""
    if status != "error":
        return status, error
    if sc.impl == REFERENCE_IMPL:
        return status, (
            f"{MODEL_LIMIT} the plain model itself fails in this scenario, no implementation involved "
            f"({_last_line(error)}):\n{error}"
        )
    mine = {line.strip() for line in str(error).splitlines()}
    for dep in (sc.reference(), *sc.noise_probes()):
        theirs = results.get(dep.id, {})
        raised = _last_line(theirs.get("error", ""))
        # the plain run's exception line, raised on some rank of this run ("rank 3 failed too: <it>" included)
        if raised and (raised in mine or any(line.endswith(": " + raised) for line in mine)):
            return "unsupported", (
                f"{MODEL_LIMIT} fails as the plain model fails in {dep.id} ({raised}); the model "
                "cannot run this scenario, whoever shards it"
            )
    return status, error


def _last_line(error: str) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def settings(sc: Scenario) -> dict:
    """What a scenarios-table row records of the run's settings beside its id fields."""
    return {"steps": sc.steps, "lr": sc.lr, "global_batch": sc.global_batch, "backend": sc.backend}


def rank_row_diffs(
    sid: str, step: int, ranks: list[dict], cur: dict, ref: dict | None, ws1: dict | None, d_ref: dict, d_ws1: dict
) -> list[dict]:
    """Per rank, the largest |param diff| within the dim-0 rows that rank holds (its record's `rows`), for
    every parameter that differs at all at this step: which ranks' rows parted from the yardstick."""
    out = []
    if len(ranks) < 2:
        return out
    for name, t in cur.items():
        if not (d_ref.get(name, 0.0) or d_ws1.get(name, 0.0)):
            continue
        by_row_ref, by_row_ws1 = _row_diffs(t, ref, name), _row_diffs(t, ws1, name)
        for rec in ranks:
            span = rec.get("rows", {}).get(name)
            if span is None:
                continue
            a, b = span
            out.append(
                {
                    "scenario": sid,
                    "step": step,
                    "param": name,
                    "rank": rec["rank"],
                    "diff_ref": _span_max(by_row_ref, a, b),
                    "diff_ws1": _span_max(by_row_ws1, a, b),
                }
            )
    return out


def _row_diffs(t: torch.Tensor, other: dict | None, name: str) -> np.ndarray | None:
    """max |t - other[name]| of each dim-0 row, in float64 (None where there is nothing to compare it with)."""
    o = None if other is None else other.get(name)
    if o is None or o.shape != t.shape:
        return None
    rows = t.shape[0] if t.dim() else 1
    if not t.numel():
        return np.zeros(rows)
    return (t.double() - o.double()).abs().reshape(rows, -1).amax(dim=1).numpy()


def _span_max(by_row: np.ndarray | None, a: int, b: int) -> float:
    if by_row is None:
        return math.nan
    rows = by_row[a:b]  # no rows (an empty shard, a reshaped report): nothing differs
    return float(rows.max()) if rows.size else 0.0


def _restore(sc: Scenario, snaps: _Snapshots, by_id: dict) -> dict:
    """A resumed run right after loading against its saver at the saved step: its parameters, and the
    optimizer state its ranks hold against what the saver's ranks held (harness.tables.restored_state)."""
    saver = sc.saver()
    if saver is None or not sc.resume_from:
        return {}
    step = ckpt_step(sc.steps)
    mine = snaps.get(sc.id, step)
    theirs = snaps.get(saver.id, step) if saver.id in by_id else None
    out = {}
    if mine and theirs is not None:
        name, worst = _worst(param_diffs(mine, theirs))
        out = {"restore_diff": worst, "restore_param": name}
    if saver.id in by_id and sc.id in snaps.dirs and saver.id in snaps.dirs:
        out.update(compare_files(Path(snaps.dirs[saver.id]) / SAVED_STATE, Path(snaps.dirs[sc.id]) / RESTORED_STATE))
    return out


def _calm(sc: Scenario, snaps: _Snapshots, by_id: dict, steps: list[int]) -> dict:
    """A timing-perturbed run (jitter) against its calm twin (Scenario.calm): the first step, parameter and
    element where their snapshots differ bit for bit, from the initial parameters on (none: calm_step NaN),
    and how many steps' snapshots both have (calm_compared)."""
    calm = sc.calm()
    if calm is None or calm.id not in by_id or not steps:
        return {}
    compared = 0
    for k in [steps[0] - 1] + steps:
        mine, theirs = snaps.get(sc.id, k), snaps.get(calm.id, k)
        if mine is None or theirs is None:
            continue
        compared += 1
        for name, t in mine.items():
            where = bitwise_difference(t, theirs.get(name))
            if where:
                return {"calm_step": k, "calm_param": name, "calm_element": where, "calm_compared": compared}
    return {"calm_step": math.nan, "calm_param": "", "calm_element": "", "calm_compared": compared}


def bitwise_difference(t: torch.Tensor, other: torch.Tensor | None) -> str:
    """'' when `other` holds the same bits as `t` and they are finite; else the first element that differs (or
    is not finite) with both values and how many do ('(3, 7): 0.125 vs 0.12500001; 12 of 512 elements differ'),
    or what is missing. A NaN or an infinity in both counts: equal bits there prove nothing about what was
    computed (any two computations that overflow alike look the same)."""
    if other is None:
        return "missing from the calm run"
    if other.shape != t.shape or other.dtype != t.dtype:
        return f"shape {tuple(t.shape)} {t.dtype}, the calm run's {tuple(other.shape)} {other.dtype}"
    a, b = t.detach().reshape(-1), other.detach().reshape(-1)
    differ = (a.view(torch.uint8).view(-1, a.element_size()) != b.view(torch.uint8).view(-1, b.element_size())).any(1)
    if a.is_floating_point():
        differ |= ~torch.isfinite(a) | ~torch.isfinite(b)
    if not bool(differ.any()):
        return ""
    i = int(differ.nonzero()[0])
    index = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), t.shape)) if t.dim() else ()
    return (
        f"{index}: {a[i].item()!r} vs {b[i].item()!r}; "
        f"{int(differ.sum())} of {a.numel()} elements differ or are not finite"
    )


def _coverage(sid: str, step: int, cur: dict, ref: dict) -> list[dict]:
    """What `full_params` got wrong against the plain model's parameters at one step: a name it left
    out, a name the plain model does not have, or another shape. Empty when every parameter of the
    plain model came back under its name with its shape."""
    rows = [{"scenario": sid, "step": step, "param": n, "problem": "missing"} for n in ref if n not in cur]
    rows += [
        {"scenario": sid, "step": step, "param": n, "problem": "not a parameter of the plain model"}
        for n in cur
        if n not in ref
    ]
    rows += [
        {
            "scenario": sid,
            "step": step,
            "param": n,
            "problem": f"shape {tuple(cur[n].shape)}, the plain model's is {tuple(ref[n].shape)}",
        }
        for n in cur
        if n in ref and cur[n].shape != ref[n].shape
    ]
    return rows


def _worst(diffs: dict[str, float]) -> tuple[str, float]:
    if not diffs:
        return "", math.nan
    name = max(diffs, key=lambda n: (math.isnan(diffs[n]), diffs[n]))
    return name, diffs[name]
