"""Run the batch-invariant tier and judge it: every claimed-invariant implementation at every world size, in
both data modes, held at bound 0 (bitwise) to

    invariant_matches_tree   the plain model (the reference adapter) summing the same L micro-batches in the same
                             binary tree at one rank: every parameter after every step, and the loss
    invariant_across_ws      the same implementation at the smallest world size of the run, same data mode
    invariant_ranks_agree    every rank's loss of every step (a rank that returns its own partial sum fails)

The tier holds a claim: an implementation that does not declare ``batch_invariant`` gets ``unsupported`` verdicts
(named), one that declares it without ``invariant_forward_backward`` fails (not measured), never a pass.

Tables: "invariant" (one row per scenario and step: loss, the largest |param diff| to the tree reference and to
the smallest world size).
"""

from __future__ import annotations

import itertools
import math
import tempfile

import pandas as pd

from harness.core.policy import INVARIANT_MICRO_BATCHES
from harness.core.scenario import ckpt_step, scenario_id
from harness.core.verdict import FAIL, PASS, UNSUPPORTED, Verdict
from harness.execute.world import WorldPool, call_or_error

TASK = "harness.invariant.task:train_invariant"
FEATURE = "invariant"
CHECKS = ("invariant_matches_tree", "invariant_across_ws", "invariant_ranks_agree")
COLUMNS = [
    "scenario",
    "impl",
    "model",
    "world_size",
    "data_mode",
    "optimizer",
    "feature",
    "step",
    "loss",
    "diff_tree",
    "diff_ws_min",
]


def sid(
    impl: str,
    model: str,
    world_size: int,
    mode: str,
    optimizer: str,
    seed: int,
    feature: str = "plain",
    resume_from: int = 0,
) -> str:
    return scenario_id(
        impl,
        model,
        world_size,
        mode,
        optimizer,
        seed=seed,
        resume_from=resume_from,
        feature=FEATURE if feature == "plain" else f"{feature}+{FEATURE}",
    )


def _resumed(pool: WorldPool, saver: int, world_size: int, payload: dict) -> tuple[list | None, str]:
    """The ckpt run: the first ckpt_step(steps) steps at `saver` ranks, saved; the rest at `world_size`, loaded.
    Every rank's result joins both parts (the saver's rank 0 parameters, then the loader's)."""
    first = ckpt_step(payload["steps"])
    with tempfile.TemporaryDirectory(prefix="fsdp-harness-invariant-") as tmp:
        saved, err = _call(pool, saver, {**payload, "last": first, "save": f"{tmp}/ckpt"})
        if saved is None or "unsupported" in saved[0]:
            return saved, err
        loaded, err = _call(pool, world_size, {**payload, "first": first + 1, "load": f"{tmp}/ckpt"})
    if loaded is None:
        return None, err
    return [
        {"losses": saved[0]["losses"] + r["losses"], "params": saved[0]["params"] + r["params"]} for r in loaded
    ], ""


def _call(pool: WorldPool, world_size: int, payload: dict) -> tuple[list | None, str]:
    return call_or_error(pool, world_size, TASK, payload)


def step_differences(a: list[dict], b: list[dict]) -> list[tuple[float, str]]:
    """Per step: (the largest |difference| over its parameters, the parameter where it is); a parameter missing on
    one side, or of another shape, or NaN on one side, is an infinite difference. (0, '') when bitwise equal."""
    out = []
    for x, y in zip(a, b):
        worst, where = 0.0, ""
        for name in sorted(set(x) | set(y)):
            if name not in x or name not in y or x[name].shape != y[name].shape:
                d = math.inf
            else:
                d = float((x[name].double() - y[name].double()).abs().max()) if x[name].numel() else 0.0
                d = d if d == d else math.inf  # NaN on one side
            if d > worst:
                worst, where = d, name
        out.append((worst, where))
    return out


def first_difference(steps: list[tuple[float, str]], complete: bool = True) -> tuple[float, int | None, str]:
    """From `step_differences`: (the largest over every step, the first step where any differs, that step's worst
    parameter); (0, None, '') when bitwise equal; `complete` False (a run with steps missing): infinite."""
    if not complete:
        return math.inf, len(steps) + 1, "(steps missing)"
    first = next(((i, p) for i, (d, p) in enumerate(steps, start=1) if d > 0), (None, ""))
    return max((d for d, _ in steps), default=0.0), first[0], first[1]


def run_invariant(
    impls,
    models,
    world_sizes,
    data_modes,
    optimizers,
    *,
    steps: int = 3,
    seed: int = 0,
    lr: float = 1e-2,
    global_batch: int = 16,
    micro: int = INVARIANT_MICRO_BATCHES,
    features=("plain",),
    pool: WorldPool | None = None,
    progress=None,
) -> tuple[dict[str, pd.DataFrame], list[Verdict]]:
    """The tier for `impls` (adapter names) under each of `features` (harness.invariant.task.FEATURES; ckpt: each
    world size resumes the checkpoint the next one saved); returns ({"invariant": table}, verdicts)."""
    from harness.invariant.task import FEATURES as SUPPORTED

    unknown = [f for f in features if f not in SUPPORTED]
    if unknown:
        raise ValueError(f"the batch-invariant tier runs {', '.join(SUPPORTED)}, not {', '.join(unknown)}")
    sizes = sorted(world_sizes)
    if micro & (micro - 1) or any(micro % w for w in sizes) or global_batch % micro:
        raise ValueError(
            f"the batch-invariant tier needs L = {micro} micro-batches: a power of two that every world "
            f"size ({', '.join(map(str, sizes))}) divides and that divides the global batch "
            f"({global_batch})"
        )
    unclaimed = {impl: why for impl in impls if (why := unclaimed_reason(impl))[1]}
    own = pool is None
    pool = pool or WorldPool()
    rows, verdicts = [], []
    try:
        for model, opt, feature in itertools.product(models, optimizers, features):
            base = {
                "model": model,
                "optimizer": opt,
                "micro": micro,
                "steps": steps,
                "seed": seed,
                "lr": lr,
                "global_batch": global_batch,
                "feature": feature,
            }
            # the yardstick trains without interruption
            ref, ref_err = _call(
                pool,
                1,
                {**base, "feature": feature.replace("ckpt", "plain"), "impl": "reference", "data_mode": "split"},
            )
            for impl, mode in itertools.product(impls, data_modes):
                smallest = None
                for i, w in enumerate(sizes):
                    saver = sizes[(i + 1) % len(sizes)] if feature == "ckpt" else 0
                    s = sid(impl, model, w, mode, opt, seed, feature, saver)
                    if impl in unclaimed:
                        status, why = unclaimed[impl]
                        verdicts += [Verdict(c, s, status, None, None, message=why) for c in CHECKS]
                        continue
                    payload = {**base, "impl": impl, "data_mode": mode}
                    got, err = _resumed(pool, saver, w, payload) if saver else _call(pool, w, payload)
                    if progress:
                        progress(s)
                    if got is not None and "unsupported" in got[0]:
                        verdicts += [
                            Verdict(c, s, UNSUPPORTED, None, None, message=got[0]["unsupported"]) for c in CHECKS
                        ]
                        continue
                    if got is None or ref is None:
                        why = err or f"the tree reference raised: {ref_err}"
                        verdicts += [Verdict(c, s, FAIL, None, 0.0, message=f"not measured: {why}") for c in CHECKS]
                        continue
                    smallest = smallest or (w, got[0])
                    verdicts += judge(s, got, ref[0], smallest, rows, (impl, model, w, mode, opt, feature))
    finally:
        if own:
            pool.close()
    return {"invariant": pd.DataFrame(rows, columns=COLUMNS)}, verdicts


def unclaimed_reason(impl: str) -> tuple[str, str]:
    """(status, why) when the tier does not train `impl`: UNSUPPORTED where it does not claim invariance (the
    tier does not apply), FAIL where it claims it and has no invariant step to hold it by; ('', '') otherwise."""
    from harness.adapters import load_adapter

    adapter = load_adapter(impl)
    if not getattr(adapter, "batch_invariant", False):
        return UNSUPPORTED, (
            f"adapter '{adapter.name}' does not declare batch_invariant: the tier holds "
            f"implementations that claim training independent of the world size "
            f"(harness/adapters/base.py)"
        )
    if not callable(getattr(adapter, "invariant_forward_backward", None)):
        return FAIL, (
            f"not measured: adapter '{adapter.name}' declares batch_invariant but has no "
            f"invariant_forward_backward() method to train it by (harness/adapters/base.py)"
        )
    return "", ""


def judge(s: str, got: list[dict], ref: dict, smallest: tuple[int, dict], rows: list, cell: tuple) -> list[Verdict]:
    """The three verdicts of one scenario (`got`: every rank's result) and its table rows."""
    mine = got[0]
    w0, small = smallest
    to_tree, to_small = (
        step_differences(mine["params"], ref["params"]),
        step_differences(mine["params"], small["params"]),
    )
    tree = first_difference(to_tree, len(mine["params"]) == len(ref["params"]))
    across = first_difference(to_small, len(mine["params"]) == len(small["params"]))
    loss_tree = next((i for i, (a, b) in enumerate(zip(mine["losses"], ref["losses"]), 1) if a != b), None)
    loss_across = next((i for i, (a, b) in enumerate(zip(mine["losses"], small["losses"]), 1) if a != b), None)
    disagree = [r for r, res in enumerate(got) if res["losses"] != mine["losses"]]
    for step, loss in enumerate(mine["losses"], start=1):
        rows.append(
            [
                s,
                *cell[:6],
                step,
                loss,
                to_tree[step - 1][0] if step <= len(to_tree) else math.inf,
                to_small[step - 1][0] if step <= len(to_small) else math.inf,
            ]
        )
    return [
        _verdict(
            "invariant_matches_tree",
            s,
            tree,
            loss_tree,
            mine,
            ref,
            "the plain model summing the same micro-batches in the same tree at one rank",
        ),
        _verdict(
            "invariant_across_ws", s, across, loss_across, mine, small, f"the same implementation at world size {w0}"
        ),
        Verdict(
            "invariant_ranks_agree",
            s,
            PASS if not disagree else FAIL,
            float(len(disagree)),
            0.0,
            message=(
                "every rank returned the same loss at every step"
                if not disagree
                else f"rank {disagree[0]} returned losses {got[disagree[0]]['losses']} where rank 0 returned "
                f"{mine['losses']}"
            ),
            rank=disagree[0] if disagree else None,
        ),
    ]


def _verdict(
    check: str, s: str, params: tuple, loss_step: int | None, mine: dict, other: dict, against: str
) -> Verdict:
    worst, step, param = params
    if worst == 0 and loss_step is None:
        return Verdict(
            check,
            s,
            PASS,
            0.0,
            0.0,
            message=f"bitwise {against}: every parameter after every step and the loss (max |diff| 0)",
        )
    if step is None or (loss_step is not None and loss_step <= step):
        return Verdict(
            check,
            s,
            FAIL,
            worst,
            0.0,
            step=loss_step,
            param="loss",
            message=f"differs from {against}: loss {mine['losses'][loss_step - 1]!r} against "
            f"{other['losses'][loss_step - 1]!r} at step {loss_step} (max |param diff| {worst:.3g})",
        )
    return Verdict(
        check,
        s,
        FAIL,
        worst,
        0.0,
        step=step,
        param=param,
        message=f"differs from {against}: max |param diff| {worst:.3g}, first at step {step} in {param}",
    )
