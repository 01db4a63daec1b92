"""Small synthetic tables in the harness schema (harness/tables/build.py), built from closed formulas.

Tests compute their expectations from the formulas and constants here, never from the code under
test. One (impl, model, optimizer) over world sizes x data modes, plus the reference run.
"""

from __future__ import annotations

import pandas as pd

from harness.checks.registry import verdict_table
from harness.core.scenario import Scenario
from harness.core.verdict import FAIL, KNOWN, PASS, SKIP, Verdict
from harness.tables.schema import columns

IMPL, MODEL, OPT = "fsdp_impl", "mlp", "adamw"
PARAMS = {"layers.0.weight": 4096, "layers.0.bias": 64, "layers.1.weight": 640}
ROWS = 64 + 64 + 10  # dim-0 rows of PARAMS (64 x 64, 64, 10 x 64); every one moved by every run
PARAM_BYTES = 1 << 20  # full parameter bytes at one rank (1 MiB): state = 4x this (param, grad, 2 Adam)
ACT_BYTES = 256 << 10  # activations of the global batch
OTHER_BYTES = 1000
# The failing scenario: split data at 4 ranks diverges from step FAIL_STEP in FAIL_PARAM.
FAIL_STEP, FAIL_PARAM, FAIL_DIFF, SPLIT_BOUND = 3, "layers.1.weight", 2.5e-3, 1e-5
# The known deviation: replicated data at 4 ranks, fp32 ring-sequential reduce.
KNOWN_DIFF, REPL_BOUND = 1.2e-6, 3e-8
KNOWN_CAUSE = "gloo sums ring-sequentially in fp32, so 4 identical summands are not exact"
STEP_TIME = 0.05


def scenario(ws: int, mode: str, impl: str = IMPL) -> Scenario:
    return Scenario(impl, MODEL, ws, mode, OPT, steps=5)


def sid(ws: int, mode: str, impl: str = IMPL) -> str:
    return scenario(ws, mode, impl).id


REF_ID = scenario(1, "replicated").reference().id


def is_failing(ws: int, mode: str, fail: bool) -> bool:
    return fail and ws == 4 and mode == "split"


def is_known(ws: int, mode: str) -> bool:
    return ws == 4 and mode == "replicated"


def loss_at(step: int, ws: int, mode: str, fail: bool = True) -> float:
    """Global loss at a step (steps count from 1)."""
    loss = 2.0 * 0.8**step + (1e-9 * (ws - 1) * step if mode == "split" else 0.0)
    return loss + (1e-3 if is_failing(ws, mode, fail) and step >= FAIL_STEP else 0.0)


def param_diff(step: int, ws: int, mode: str, param: str, fail: bool = True) -> float:
    """|param - reference| for one parameter; exactly 0 at one rank."""
    if ws == 1:
        return 0.0
    if is_failing(ws, mode, fail) and step >= FAIL_STEP and param == FAIL_PARAM:
        return FAIL_DIFF * (step - FAIL_STEP + 1)
    if mode == "split":
        return 1e-7 * step * ws * (1 + list(PARAMS).index(param)) / len(PARAMS)
    return KNOWN_DIFF * step / 5 if is_known(ws, mode) and param == FAIL_PARAM else 0.0


def mem(ws: int, mode: str) -> dict[str, int]:
    """Bytes per rank by category (every rank equal)."""
    cats = {
        "params": PARAM_BYTES // ws,
        "grads": PARAM_BYTES // ws,
        "optimizer_state": 2 * PARAM_BYTES // ws,
        "activations": ACT_BYTES // ws if mode == "split" else ACT_BYTES,
        "other": OTHER_BYTES,
        "state_buffers": 0,
        "state_other": 0,
    }
    cats["state_total"] = cats["params"] + cats["grads"] + cats["optimizer_state"]
    cats["peak"] = cats["state_total"] + cats["activations"] + cats["other"]
    return cats


def comm(ws: int) -> dict[str, tuple[int, int]]:
    """collective -> (calls, bytes) per step; a single rank moves nothing."""
    if ws == 1:
        return {}
    wire = PARAM_BYTES * (ws - 1) // ws
    return {"all_gather_into_tensor": (4, 2 * wire), "reduce_scatter_tensor": (2, wire)}


def gathered(ws: int) -> list[dict]:
    """A ZeRO-3 timeline: one unit at a time in forward, two in backward (one prefetched)."""
    units = {"forward": 1, "after_forward": 0, "backward": 2, "after_backward": 0, "optimizer": 0}
    return [
        dict(
            phase=p, moments=10, units=3 if ws == 1 else n, which="a, b" if n else "", root=p in ("forward", "backward")
        )
        for p, n in units.items()
    ]


def _rows(sc: Scenario, fail: bool, steps: int):
    ws, mode = sc.world_size, sc.data_mode
    head = dict(
        scenario=sc.id,
        impl=sc.impl,
        model=sc.model,
        world_size=ws,
        data_mode=mode,
        optimizer=sc.optimizer,
        seed=sc.seed,
        micro_batches=sc.micro_batches,
    )
    step_rows, param_rows = [], []
    for step in range(1, steps + 1):
        diffs = {p: param_diff(step, ws, mode, p, fail) for p in PARAMS}
        worst = max(diffs, key=lambda p: diffs[p])
        step_rows.append(
            dict(
                head,
                step=step,
                loss=loss_at(step, ws, mode, fail),
                grad_norm=1.0 / step,
                max_diff_ref=diffs[worst],
                worst_param_ref=worst,
                max_diff_ws1=diffs[worst],
                worst_param_ws1=worst,
                grad_diff_ws1=diffs[worst] if ws > 1 and mode == "replicated" else float("nan"),
            )
        )
        for p, n in PARAMS.items():
            param_rows.append(
                dict(
                    scenario=sc.id,
                    step=step,
                    param=p,
                    numel=n,
                    diff_ref=diffs[p],
                    diff_ws1=diffs[p],
                    sum=0.5 * n + diffs[p],
                )
            )
    last = step_rows[-1]
    m = mem(ws, mode)
    scen = dict(
        head,
        steps=steps,
        lr=sc.lr,
        global_batch=sc.global_batch,
        backend=sc.backend,
        status="ok",
        error="",
        final_loss=last["loss"],
        param_sum=sum(r["sum"] for r in param_rows if r["step"] == steps),
        max_diff_ref=max(r["max_diff_ref"] for r in step_rows),
        max_diff_ws1=max(r["max_diff_ws1"] for r in step_rows),
        sharded=sc.impl != "reference",
        param_bytes=PARAM_BYTES,
        trainable_bytes=PARAM_BYTES,
        param_elements=PARAM_BYTES // 4,
        trainable_elements=PARAM_BYTES // 4,
        largest_unit_bytes=PARAM_BYTES // 2,
        largest_child_bytes=PARAM_BYTES // 4,
        root_bytes=PARAM_BYTES // 4,
        row_bytes=64,
        param_tensors=len(PARAMS),
        buffer_bytes=0,
        params_compared=len(PARAMS),
        rows_compared=ROWS,
        rows_moved=ROWS,
        params_moved=len(PARAMS),  # every parameter trains
        state_bytes=m["state_total"],
        peak_bytes=m["peak"],
        step_time_s=STEP_TIME * ws,
    )
    return step_rows, param_rows, scen


def _verdicts(world_sizes, modes, fail: bool, steps: int) -> list[dict]:
    out = []
    for ws in world_sizes:
        for mode in modes:
            sc_id = sid(ws, mode)
            worst = max(param_diff(steps, ws, mode, p, fail) for p in PARAMS)
            if ws == 1:
                out.append(
                    dict(
                        check="ws1_exact",
                        scenario=sc_id,
                        status=PASS,
                        measured=0.0,
                        bound=0.0,
                        where="",
                        message="losses and parameters bitwise equal to the reference",
                    )
                )
            elif mode == "replicated":
                st = KNOWN if is_known(ws, mode) else PASS
                msg = KNOWN_CAUSE if st == KNOWN else "max |param diff| within the replicated bound"
                at = dict(step=1, param=FAIL_PARAM) if st == KNOWN else {}
                out.append(
                    dict(
                        check="cross_ws_replicated",
                        scenario=sc_id,
                        status=st,
                        measured=worst,
                        bound=REPL_BOUND,
                        message=msg,
                        **at,
                    )
                )
            else:
                bad = is_failing(ws, mode, fail)
                out.append(
                    dict(
                        check="split_matches_full_batch",
                        scenario=sc_id,
                        status=FAIL if bad else PASS,
                        measured=worst,
                        bound=SPLIT_BOUND,
                        **(dict(step=FAIL_STEP, param=FAIL_PARAM) if bad else {}),
                        message=(
                            "max |param diff| vs reference exceeds the split-data bound"
                            if bad
                            else "max |param diff| within the split-data bound"
                        ),
                    )
                )
    out.append(
        dict(
            check="per_sample_norms",
            scenario=sid(1, "replicated"),
            status=SKIP,
            measured=None,
            bound=None,
            where="",
            message="not applicable: this impl computes no per-sample norms",
        )
    )
    return out


def frame(name: str, rows: list[dict], extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """A table of the harness schema (harness/tables/schema.py) from rows that hold some of its
    columns, in the schema's order; a key the schema does not know (a builder gone stale) raises."""
    known = columns(name)
    unknown = {k for r in rows for k in r} - set(known) - set(extra)
    if unknown:
        raise KeyError(f"table '{name}' has no columns {sorted(unknown)} in the schema")
    present = [c for c in known if not rows or any(c in r for r in rows)]
    return pd.DataFrame(rows, columns=present + [c for c in extra if any(c in r for r in rows)])


def make_tables(
    *,
    world_sizes=(1, 2, 4),
    modes=("replicated", "split"),
    steps: int = 5,
    fail: bool = True,
    ideal_memory: bool = False,
) -> dict[str, pd.DataFrame]:
    """All nine tables for the reference run plus every (world size, data mode) cell."""
    steps_rows, param_rows, scen_rows, mem_rows, comm_rows, gathered_rows = [], [], [], [], [], []
    cells = [scenario(1, "replicated").reference()] + [scenario(ws, m) for ws in world_sizes for m in modes]
    cells += sorted({p for sc in cells for p in sc.noise_probes()}, key=lambda p: p.id)  # finding no noise
    for sc in cells:
        s, p, row = _rows(sc, fail, steps)
        steps_rows += s
        param_rows += p
        scen_rows.append(row)
        ideal1 = mem(1, sc.data_mode)
        for rank in range(sc.world_size):
            for cat, b in mem(sc.world_size, sc.data_mode).items():
                r = dict(scenario=sc.id, rank=rank, category=cat, bytes=b)
                if ideal_memory:
                    r["ideal_bytes"] = ideal1[cat] // sc.world_size
                mem_rows.append(r)
        for rank in range(sc.world_size):
            gathered_rows += [dict(scenario=sc.id, rank=rank, **g) for g in gathered(sc.world_size)]
        for coll, (calls, b) in comm(sc.world_size).items():
            comm_rows.append(
                dict(scenario=sc.id, collective=coll, dtype="float32", calls=calls, elements=b // 4, bytes=b)
            )
    return {
        "steps": frame("steps", steps_rows),
        "params": frame("params", param_rows),
        "scenarios": frame("scenarios", scen_rows),
        "memory": frame("memory", mem_rows, extra=("ideal_bytes",)),
        "comm": frame("comm", comm_rows),
        "coverage": frame("coverage", []),
        "rows_trained": frame("rows_trained", []),
        "gathered": frame("gathered", gathered_rows),
        "verdicts": verdict_table([Verdict(**v) for v in _verdicts(world_sizes, modes, fail, steps)]),
    }


ENV = {
    "torch": "2.13.0",
    "backend": "gloo",
    "device": "cpu",
    "seed": 0,
    "git_commit": "abc1234",
    "date": "2025-01-01T00:00:00",
    "command": "fsdp-harness run --world-sizes 1,2,4",
}


def make_per_sample_tables(*, world_sizes=(1, 2), samples: int = 4) -> dict[str, pd.DataFrame]:
    """The two per-sample tables (`--per-sample`) for fsdp_impl on the mlp, split data: norm of
    sample i = truth = 1 + i/10, so every ratio of means is 1."""
    truth = [1 + i / 10 for i in range(samples)]
    rows = [
        dict(model=MODEL, impl=IMPL, data_mode="split", world_size=ws, sample=i, norm=t, truth=t)
        for ws in world_sizes
        for i, t in enumerate(truth)
    ]
    mean = sum(truth) / samples
    summary = [
        dict(
            model=MODEL,
            impl=IMPL,
            data_mode="split",
            world_size=ws,
            mean_norm=mean,
            truth_mean=mean,
            ratio_of_means=1.0,
            max_rel_err=0.0,
            clipped_update_rel_err=0.0,
            update_ratio=1.0,
        )
        for ws in world_sizes
    ]
    return {"per_sample": frame("per_sample", rows), "per_sample_summary": frame("per_sample_summary", summary)}


# -- small hand-made tables for single checks (suites/harness/unit/test_checks.py, test_timeline.py) --------------

P_BYTES = 4000  # full parameter bytes of the pretend model


def cell(impl, ws, mode="replicated", opt="adamw"):
    """A 3-step mlp scenario for the check builders below."""
    return Scenario(impl, "mlp", ws, mode, opt, steps=3)


def with_probes(cells, floor=(0.0, 0.0, 0.0)):
    """`cells` plus the noise probe of every split cell that has none among them (Scenario.noise_probes),
    each `floor` away from the reference at every step (0: the plain model's own cut changes nothing)."""
    have = {c[0] for c in cells}
    probes = {p for c in cells for p in c[0].noise_probes() if p not in have}
    return list(cells) + [(p, LOSSES, list(floor), list(floor)) for p in sorted(probes, key=lambda p: p.id)]


def check_tables(cells, probes: bool = True):
    """cells: list of (Scenario, losses[3], diff_ref[3], diff_ws1[3]) -> tables; with `probes`, the noise
    probes of the split cells are added as runs that found no noise (with_probes)."""
    steps, scen, params = [], [], []
    for sc, losses, dref, dws1 in with_probes(cells) if probes else cells:
        base = {
            "scenario": sc.id,
            "impl": sc.impl,
            "model": sc.model,
            "world_size": sc.world_size,
            "data_mode": sc.data_mode,
            "optimizer": sc.optimizer,
            "seed": sc.seed,
            "micro_batches": sc.micro_batches,
        }
        for k in range(3):
            steps.append(
                {
                    **base,
                    "step": k + 1,
                    "loss": losses[k],
                    "grad_norm": 1.0,
                    "max_diff_ref": dref[k],
                    "worst_param_ref": "fc2.weight",
                    "max_diff_ws1": dws1[k],
                    "worst_param_ws1": "fc2.weight",
                    "grad_diff_ws1": dws1[k],
                }
            )
            params.append(
                {
                    "scenario": sc.id,
                    "step": k + 1,
                    "param": "fc2.weight",
                    "numel": 10,
                    "diff_ref": dref[k],
                    "diff_ws1": dws1[k],
                    "sum": 1.0,
                }
            )
        scen.append(
            {
                **base,
                "feature": sc.feature,
                "backend": sc.backend,
                "steps": 3,
                "lr": sc.lr,
                "status": "ok",
                "error": "",
                "sharded": True,
                "param_bytes": P_BYTES,
                "param_elements": P_BYTES // 4,
                "trainable_elements": P_BYTES // 4,
                "largest_unit_bytes": P_BYTES // 2,
                "largest_child_bytes": P_BYTES // 4,
                "root_bytes": P_BYTES // 4,
                "row_bytes": 40,
                "param_tensors": 4,
                "buffer_bytes": 0,
            }
        )
    return {
        "steps": frame("steps", steps),
        "scenarios": frame("scenarios", scen),
        "params": frame("params", params),
        "memory": frame("memory", []),
        "comm": frame("comm", []),
    }


LOSSES = [1.0, 0.8, 0.6]
ZERO = [0.0, 0.0, 0.0]


def session_with_result(report, save_baseline: str | None = None):
    """A Session (harness.session) whose matrix has run: these tables at world size 1, ready to write
    its outputs to `report` (a path, DEFAULT_REPORT or None) and a baseline named `save_baseline`."""
    from harness import options as opt
    from harness.phases import RunResult
    from harness.session import Session, SessionOptions

    session = Session(SessionOptions(opt.MatrixOptions(), report=report, save_baseline=save_baseline))
    tables = make_tables(world_sizes=(1,), modes=("replicated",))
    session.result = RunResult([], tables, [], {"device": "cpu", "torch": "2.13.0+cpu", "cpu_capability": "AVX2"}, 0.0)
    return session
