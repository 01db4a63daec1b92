"""Per-sample gradient norms for the verification report: run ``harness.per_sample.tasks``'s
tasks in worlds (one per world size, every scenario of that size in it) and turn them into the
"per_sample" and "per_sample_summary" tables plus ``Verdict``s.

Implementations (the ``impl`` column):

- ``fsdp_impl``: the product; verdicts ``per_sample_norms`` and ``clipped_update``.
- ``allreduce``: the known-bad position-wise all-reduce of per-sample norms, a NEGATIVE CONTROL.
  Its ``per_sample_norms`` check is expected to fail; the verdict ``per_sample_norms_negative_control``
  passes when the check catches the bug and fails when it does not (skipped at W=1: one rank's
  all-reduce is the identity, so there is no bug to catch).
- ``opacus``: Opacus' ghost_fsdp recipe through ``make_private`` (when importable), as measured.
  Its local norms, placed by global index, are checked like fsdp_impl's. With replicated data at
  W>1 its update is W times the exact one; that is reported as ``known`` with its cause.

Every impl x mode x W row comes from rank 0; the checks look at every rank.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import pandas as pd
import torch

from harness.core.policy import OPACUS_EMPTY_SHARD
from harness.core.scenario import scenario_id
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, Verdict
from harness.execute.world import WorldPool, call_or_error
from harness.per_sample import tasks as ps
from harness.per_sample.section import NEGATIVE_CONTROL
from harness.tables.schema import columns
from harness.train.models import get_model_spec

LR = 1.0
IMPLS = ("fsdp_impl", "allreduce", "opacus")


def max_norm(model: str, seed: int, batch: int) -> float:
    """Clip bound C: the median truth norm, so about half the batch is clipped."""
    return statistics.median(ps.truth(model, seed, batch).norms)


def update_ratio(update: dict[str, list], exact: dict) -> float:
    """|update| / |exact update| over all parameters (2-norms)."""
    num = sum(sum(v * v for v in update[k]) for k in exact)
    den = sum(float(t.pow(2).sum()) for t in exact.values())
    return math.sqrt(num / den) if den else math.nan


TASKS = "harness.per_sample.tasks"


def _run(pool: WorldPool, world_size: int, fn: str, payload: dict) -> tuple[list | None, str]:
    """(per-rank results, '') or (None, the error's first line); a failed world is rebuilt on next get."""
    return call_or_error(pool, world_size, f"{TASKS}:{fn}", payload)


def _small_dims(model: str, world_size: int) -> str:
    """Parameters whose dim 0 is below W (FSDP2 leaves some rank an empty shard), for error notes."""
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        params = get_model_spec(model).build().named_parameters()
        small = [f"{k} {tuple(p.shape)}" for k, p in params if p.dim() and p.shape[0] < world_size]
    return f" Note: dim 0 < W={world_size} (some rank holds an empty shard) for {', '.join(small)}." if small else ""


def opacus_raised(sid: str, model: str, world_size: int, err: str) -> list[Verdict]:
    """Opacus raised, so nothing was measured: a FAIL, or KNOWN where the documented cause holds (a
    parameter whose dim 0 is below W leaves some rank an empty shard, harness/core/policy.py)."""
    small = _small_dims(model, world_size)
    status, cause = (KNOWN, f" Known deviation: {OPACUS_EMPTY_SHARD.cause}.") if small else (FAIL, "")
    why = f"not measured: Opacus ghost_fsdp (make_private + one SGD step) raised: {err}.{small}{cause}"
    return [Verdict(c, sid, status, None, None, message=why) for c in ("per_sample_norms", "clipped_update")]


def negative_control(v: Verdict, world_size: int) -> Verdict:
    """The allreduce variant's expected FAIL turned into 'the check catches the bug'."""
    name = "per_sample_norms_negative_control"
    if world_size == 1:
        return Verdict(
            name,
            v.scenario,
            SKIP,
            v.measured,
            v.bound,
            message=(
                "W=1: a one-rank all-reduce is the identity, so the known-bad aggregation is correct here "
                f"and there is no bug to detect ({v.message})"
            ),
        )
    caught = v.status == FAIL
    return dataclasses.replace(
        v,
        check=name,
        status=PASS if caught else FAIL,
        message=(
            "negative control (known-bad position-wise all-reduce of per-sample norms): "
            + ("bug DETECTED by per_sample_norms" if caught else "bug NOT detected: per_sample_norms passed")
            + f" - {v.message}"
        ),
    )


def opacus_update_verdict(
    v: Verdict, ratio: float, world_size: int, mode: str, expected_bs: set, batch: int
) -> Verdict:
    """Opacus' clipped_update as measured; the replicated-data W-times update is a known finding."""
    explained = (
        v.status == FAIL
        and mode == "replicated"
        and world_size > 1
        and abs(ratio - world_size) < 1e-3
        and expected_bs == {batch / world_size}
    )
    if not explained:
        return v
    return dataclasses.replace(
        v,
        status=KNOWN,
        message=(
            f"Opacus make_private with replicated data: update is {ratio:.4f}x the exact clipped-mean update "
            f"(W={world_size}). Cause: make_private sets expected_batch_size = len(dataset) * sample_rate / "
            f"world_size = {batch / world_size:g} (the per-worker batch, opacus/privacy_engine.py), assuming each "
            f"rank holds 1/W of the data; with replicated data each rank clips and sums all {batch} samples, so "
            f"the averaged gradient is W times the exact one. Correct with split data. ({v.message})"
        ),
    )


def _rows(model, impl, mode, ws, norms, truth_norms, nv: Verdict, upd: Verdict | None, uratio: float):
    rows = [
        dict(model=model, impl=impl, data_mode=mode, world_size=ws, sample=i, norm=float(n), truth=float(t))
        for i, (n, t) in enumerate(zip(norms, truth_norms))
    ]
    mean_n, mean_t = statistics.fmean(norms), statistics.fmean(truth_norms)
    summary = dict(
        model=model,
        impl=impl,
        data_mode=mode,
        world_size=ws,
        mean_norm=mean_n,
        truth_mean=mean_t,
        ratio_of_means=mean_n / mean_t,
        max_rel_err=nv.measured,
        clipped_update_rel_err=upd.measured if upd is not None else math.nan,
        update_ratio=uratio,
    )
    return rows, summary


def run_per_sample(
    models=("mlp",),
    world_sizes=(1, 2, 4, 8),
    modes=("replicated", "split"),
    *,
    seed=0,
    batch=8,
    pool: WorldPool | None = None,
    include_opacus=True,
    localise: int = 0,
) -> tuple[dict[str, pd.DataFrame], list[Verdict]]:
    """Run the per-sample tasks; returns ({"per_sample", "per_sample_summary"}, verdicts). `localise`: up to
    that many failing fsdp_impl norm checks are replayed traced (harness.localize.per_sample) and their
    verdicts' messages say on which side of the exchange the norms went wrong."""
    opacus_missing = ps.opacus_unavailable() if include_opacus else "not requested"
    own = pool is None
    pool = pool or WorldPool(timeout_s=600)
    rows, summary, verdicts = [], [], []
    if include_opacus and opacus_missing:
        verdicts.append(Verdict("per_sample_norms", "opacus", SKIP, None, None, message=opacus_missing))
    try:
        for ws in world_sizes:
            for model in models:
                t = ps.truth(model, seed, batch)
                exact = t.update(max_norm(model, seed, batch), LR)
                for mode in modes:
                    base = dict(model=model, seed=seed, batch=batch, mode=mode)
                    clip = dict(base, max_norm=max_norm(model, seed, batch), lr=LR)
                    sid = {i: scenario_id(i, model, ws, mode) for i in IMPLS}
                    recs, err = _run(pool, ws, "norms_task", dict(base, variants=["fsdp_impl", NEGATIVE_CONTROL]))
                    upd, uerr = _run(pool, ws, "clipped_update_task", clip)
                    if upd is None:
                        verdicts.append(
                            Verdict(
                                "clipped_update",
                                sid["fsdp_impl"],
                                FAIL,
                                None,
                                None,
                                message=f"clipped_update_task raised: {uerr}",
                            )
                        )
                        uv, ur = None, math.nan
                    else:
                        uv = ps.check_clipped_update(sid["fsdp_impl"], upd[0]["update"], exact)
                        ur = update_ratio(upd[0]["update"], exact)
                        verdicts.append(uv)
                    if recs is None:
                        verdicts += [
                            Verdict(
                                "per_sample_norms",
                                sid["fsdp_impl"],
                                FAIL,
                                None,
                                None,
                                message=f"norms_task raised: {err}",
                            ),
                            Verdict(
                                "per_sample_norms_negative_control",
                                sid[NEGATIVE_CONTROL],
                                FAIL,
                                None,
                                None,
                                message=f"not run: norms_task raised: {err}",
                            ),
                        ]
                        continue
                    for impl in ("fsdp_impl", NEGATIVE_CONTROL):
                        per_rank = [r["norms"][impl] for r in recs]
                        nv = ps.check_per_sample_norms(sid[impl], per_rank, t.norms)
                        is_fsdp = impl == "fsdp_impl"
                        if is_fsdp and nv.status == FAIL and localise > 0:
                            localise -= 1
                            nv = localised(nv, pool, ws, base, t.norms)
                        verdicts.append(nv if is_fsdp else negative_control(nv, ws))
                        r, s = _rows(
                            model,
                            impl,
                            mode,
                            ws,
                            per_rank[0],
                            t.norms,
                            nv,
                            uv if is_fsdp else None,
                            ur if is_fsdp else math.nan,
                        )
                        rows += r
                        summary.append(s)
            if include_opacus and not opacus_missing:  # last in each world: an Opacus error kills the world
                for model in models:
                    t = ps.truth(model, seed, batch)
                    exact = t.update(max_norm(model, seed, batch), LR)
                    for mode in modes:
                        sid = scenario_id("opacus", model, ws, mode)
                        clip = dict(
                            model=model, seed=seed, batch=batch, mode=mode, max_norm=max_norm(model, seed, batch), lr=LR
                        )
                        recs, err = _run(pool, ws, "opacus_fsdp_task", clip)
                        if recs is None:
                            verdicts += opacus_raised(sid, model, ws, err)
                            continue
                        nv = ps.check_per_sample_norms(sid, [r["gathered"] for r in recs], t.norms)
                        nv = dataclasses.replace(
                            nv,
                            scenario=sid,
                            message="Opacus ghost_fsdp local norms placed by global index: " + nv.message,
                        )
                        ur = update_ratio(recs[0]["update"], exact)
                        uv = opacus_update_verdict(
                            ps.check_clipped_update(sid, recs[0]["update"], exact),
                            ur,
                            ws,
                            mode,
                            {r["expected_batch_size"] for r in recs},
                            batch,
                        )
                        verdicts += [nv, uv]
                        r, s = _rows(model, "opacus", mode, ws, recs[0]["gathered"], t.norms, nv, uv, ur)
                        rows += r
                        summary.append(s)
    finally:
        if own:
            pool.close()
    return {
        "per_sample": _sorted(pd.DataFrame(rows, columns=columns("per_sample"))),
        "per_sample_summary": _sorted(pd.DataFrame(summary, columns=columns("per_sample_summary"))),
    }, verdicts


def localised(v: Verdict, pool: WorldPool, ws: int, payload: dict, truth_norms) -> Verdict:
    """`v` with where its norms went wrong appended: the norms task replayed with every collective's input
    recorded, each rank's own samples' truth norms looked for in what it sent."""
    from harness.localize.per_sample import replay

    try:
        found = replay(pool, ws, f"{TASKS}:norms_task", payload, "fsdp_impl", truth_norms).short()
    except Exception as e:  # the verdict stands; the localisation says why it could not
        found = f"could not be localised ({(str(e).strip().splitlines() or [type(e).__name__])[-1]})"
    return dataclasses.replace(v, message=f"{v.message.rstrip('. ')}. Where it diverged: {found}")


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    """model, impl (fsdp_impl, allreduce, opacus), data mode, world size[, sample]."""
    order = {i: k for k, i in enumerate(IMPLS)}
    keys = ["model", "impl", "data_mode", "world_size"] + (["sample"] if "sample" in df else [])
    return df.sort_values(keys, key=lambda c: c.map(order) if c.name == "impl" else c, kind="stable").reset_index(
        drop=True
    )


if __name__ == "__main__":  # python -m harness.per_sample.run: a quick look (W = 1, 2)
    tables, found = run_per_sample(world_sizes=(1, 2))
    print(tables["per_sample_summary"].to_string())
    print("\n".join(map(str, found)))
