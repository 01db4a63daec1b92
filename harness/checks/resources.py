"""Memory and communication checks: each scenario's measured figures held against the ZeRO-3 ideal.

Ideal per rank at world size W, for full parameters of P bytes (harness.measure):
    state    params P/W + grads P/W + optimizer state (AdamW 2P, SGD-momentum P, a user's optimizer what
             the plain reference run of the scenario holds)/W; no division
             for an adapter that declares itself unsharded (DDP), so a sharding claim can fail
    traffic  all-gather 2P (forward and backward) + gradient reduce-scatter P per step, counted in
             elements of the full size each collective handles (harness.measure.comm), bytes beside
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd

from harness.checks.common import Check, judge, not_measured, not_reference, ok_row
from harness.checks.noise_floor import split_yardstick
from harness.core.features import (
    clip_of,
    has,
    holds_unsharded_grads,
    passes_per_step,
    post_forward_ranks,
    reductions_per_step,
    shard_size,
)
from harness.core.policy import POST_FORWARD_AFTER_EVAL, ROOT_AFTER_EVAL, Bounds
from harness.core.scenario import Scenario, feature_of, user_optimizer
from harness.core.verdict import SKIP, Verdict
from harness.measure.ideals import ideal_comm_elements, ideal_state_bytes
from harness.measure.timeline import ALLOWED, ROOT_FREE, expected_phases

STATE_CATEGORIES = ("params", "grads", "optimizer_state")
# Gradient reductions after which each rank holds only its own part, and the share of a call's
# counted size that is reduced gradient: reduce_scatter and all_to_all count their input, reduce
# (to the part's owner, as ZeRO-1/2 code does) the part; gather counts the W pieces its root
# receives, of which the root keeps the sum, one piece.
SCATTER_COLLECTIVES = ("reduce_scatter", "all_to_all", "reduce", "gather")
# Mixed-precision features: bytes of the compute copy of a parameter per byte of its fp32 master (the
# policy's param_dtype, harness.train.features.BF16_POLICY: bf16, 2 of 4 bytes). An implementation
# that does not shard (or shards over one rank) computes on such a copy of every parameter, alive
# through forward and backward: the plain bf16 model makes all of them per forward.
COMPUTE_COPY_RATIO = {"bf16": 0.5}


def _reduced(per_collective: dict, world_size: int) -> float:
    """Reduced-gradient size of these collectives' counts (elements or bytes)."""
    return sum(per_collective.get(k, 0.0) / (world_size if k == "gather" else 1) for k in SCATTER_COLLECTIVES)


def _measured_rows(tables, check: str, out: list[Verdict], applies: Callable[[object], bool] = ok_row) -> pd.DataFrame:
    """The completed scenarios this check applies to (`applies`, the predicate its entry in RESOURCE_CHECKS holds
    it to) whose parameter sizes were recorded; each one without them gets a FAIL in `out` (a check that cannot run
    never passes)."""
    sc = tables["scenarios"]
    rows = sc[sc.status == "ok"]
    if applies is not ok_row and len(rows):
        rows = rows[rows.apply(applies, axis=1).astype(bool)]
    for r in rows[rows.param_bytes.isna()].itertuples():
        out.append(not_measured(check, r, "the rank recorded no parameter sizes (param_bytes)"))
    return rows[rows.param_bytes.notna()]


def shard_padding(row, bounds: Bounds = Bounds()) -> float:
    """Most padding a rank's shard of one state category may hold: one dim-0 row per tensor
    (per-parameter dim-0 sharding, FSDP2) or alignment gaps (flat sharding), whichever layout."""
    return float(row.row_bytes) + bounds.align_bytes_per_tensor * float(row.param_tensors)


def shards(row) -> int:
    """Ranks each parameter is sharded over: W, or one replica's ranks under hybrid sharding (hsdp)."""
    return shard_size(feature_of(row), int(row.world_size))


def gather_padding(row, bounds: Bounds = Bounds()) -> float:
    """Most padding one full-size collective over all parameters may carry: W-1 rows per tensor."""
    return (shards(row) - 1) * float(row.row_bytes) + bounds.align_bytes_per_tensor * float(row.param_tensors)


def _at_most(check: str, row, measured: float, bound: float, message: str, where_over: str) -> Verdict:
    """PASS when `measured` <= `bound`; else KNOWN for a documented deviation, else FAIL (`judge`)."""
    return judge(check, row, measured <= bound, measured, bound, message, where=where_over)


def max_over_ranks(mem: pd.DataFrame, sid: str, *categories: str) -> float:
    """Max over ranks of the categories' bytes summed per rank; NaN if a category was not recorded."""
    per_rank = _per_rank(mem)
    parts = [per_rank.get((sid, c)) for c in dict.fromkeys(categories)]
    if any(p is None for p in parts):
        return math.nan
    total: dict = {}
    for part in parts:
        for rank, b in part.items():
            total[rank] = total.get(rank, 0.0) + b
    return float(max(total.values()))


_INDEXED: list = []  # [(the memory table, its stamp, (scenario, category) -> bytes per rank)]: the last one indexed


def _per_rank(mem: pd.DataFrame) -> dict:
    """The memory table's bytes per rank for each (scenario, category), {rank: bytes} (a missing value counts
    0, as a pandas sum does), indexed once per table in one grouping (the checks ask for every scenario: a scan
    of the whole table each time made verdicts quadratic in the run, a grouping per scenario slow)."""
    stamp = (len(mem), float(mem["bytes"].sum()) if len(mem) else 0.0)  # a table changed in place is indexed anew
    if not _INDEXED or _INDEXED[0][0] is not mem or _INDEXED[0][1] != stamp:
        index: dict = {}
        if len(mem):
            for (sid, cat, rank), b in mem.groupby(["scenario", "category", "rank"])["bytes"].sum().items():
                index.setdefault((sid, cat), {})[rank] = float(b)
        _INDEXED[:] = [(mem, stamp, index)]
    return _INDEXED[0][2]


def _ideal_state(tables, row) -> dict[str, int] | str:
    """`ideal_state_bytes` of the row; for a user's optimizer ([Note: user optimizer]) with the state factor
    its plain reference run measured (optimizer-state bytes per parameter byte, the whole model on one
    rank), or, where that run recorded none, a line saying what is missing."""
    factor = None
    if user_optimizer(row.optimizer):
        ref = Scenario.of_row(row).reference().id
        sc = tables["scenarios"]
        ref_rows = sc[(sc.scenario == ref) & (sc.status == "ok")]
        held = max_over_ranks(tables["memory"], ref, "state_optimizer_state") if len(ref_rows) else math.nan
        if math.isnan(held) or ref_rows.param_bytes.isna().all():
            return (
                f"the optimizer-state ideal of a user's optimizer is what its plain reference run holds, and "
                f"{ref} recorded none"
            )
        factor = held / float(ref_rows.param_bytes.iloc[0])
    return ideal_state_bytes(
        int(row.param_bytes), row.optimizer, shards(row), state_factor=factor, partitioned=partitioned(row)
    )


def memory_sharding(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Per-rank params, grads and optimizer state each within padding of the ideal (P x factor / W),
    and what the rank holds besides them (buffers, anything else the census finds) within the
    model's own buffers and a small bookkeeping allowance."""
    out, mem = [], tables["memory"]
    for row in _measured_rows(tables, "memory_sharding", out).itertuples():
        ideal = _ideal_state(tables, row)
        if isinstance(ideal, str):
            out.append(not_measured("memory_sharding", row, ideal))
            continue
        allowance = shard_padding(row, bounds)
        worst, worst_limit, where, total_measured, over = 0.0, 1.0, "", 0.0, []
        for cat in STATE_CATEGORIES:
            measured = _held_anywhere(mem, row.scenario, cat)
            if math.isnan(measured):
                where = where or f"{cat}: not measured"
                continue
            total_measured += measured
            copies = ideal[cat] / ideal["params"] if ideal["params"] else 1  # optimizer state: 2 per param (AdamW)
            limit = ideal[cat] * (1 + bounds.memory_sharding_slack) + copies * allowance
            ratio = measured / ideal[cat] if ideal[cat] else (0.0 if not measured else math.inf)
            if ratio > worst:
                worst, worst_limit = ratio, (limit / ideal[cat] if ideal[cat] else math.inf)
            over += [cat] if measured > limit else []
            if measured > limit and not where:
                where = (
                    f"{cat}: {measured:,.0f} B per rank > ideal {ideal[cat]:,.0f} B "
                    f"({ratio:.2f}x; allowed {limit:,.0f} B)"
                )
        elsewhere = max_over_ranks(mem, row.scenario, "state_other", "state_buffers")
        elsewhere_limit = (
            float(row.buffer_bytes) + bounds.memory_sharding_slack * sum(ideal.values()) + bounds.held_elsewhere_bytes
        )
        if math.isnan(elsewhere) or math.isnan(elsewhere_limit):
            where = where or "other: not measured (no census of what the rank holds)"
        elif elsewhere > elsewhere_limit:
            over.append("other")
        if "other" in over and not where:
            where = (
                f"other: {elsewhere:,.0f} B per rank held outside parameters, gradients and optimizer "
                f"state (allowed {elsewhere_limit:,.0f} B: the model's buffers + 1% + "
                f"{bounds.held_elsewhere_bytes:,} B)"
            )
        excess = {
            "params": lambda: (
                _held_anywhere(mem, row.scenario, "params")
                - (ideal["params"] * (1 + bounds.memory_sharding_slack) + allowance)
            ),
            "other": lambda: elsewhere - elsewhere_limit,
        }
        if (
            len(over) == 1
            and over[0] in excess
            and where.startswith(f"{over[0]}:")
            and _root_kept_after_eval(row, excess[over[0]]())
        ):
            where += f" ({ROOT_AFTER_EVAL}: over by at most its {float(row.root_bytes):,.0f} B)"
        elif (
            over == ["params"]
            and where.startswith("params:")
            and has(feature_of(row), "eval")
            and 0 < excess["params"]() <= _kept_after_forward(row)
        ):
            where += (
                f" ({POST_FORWARD_AFTER_EVAL}: over by at most the post-forward shards' "
                f"{_kept_after_forward(row):,.0f} B)"
            )
        kind = "sharded over" if row.sharded else "replicated on"
        mesh = (
            f" of each of {int(row.world_size) // shards(row)} replicas" if shards(row) != int(row.world_size) else ""
        )
        msg = (
            f"per-rank state {total_measured:,.0f} B vs ideal {sum(ideal.values()):,.0f} B "
            f"({kind} {shards(row) if row.sharded else row.world_size} ranks{mesh}; worst category {worst:.3f}x its ideal); "
            f"held elsewhere {elsewhere:,.0f} B"
        )
        # bound: the worst category's allowed ratio (1% slack + this model's padding allowance)
        out.append(
            judge(
                "memory_sharding",
                row,
                not where,
                worst,
                worst_limit,
                msg if not where else f"{msg}; {where}",
                where=where,
            )
        )
    return out


def _held_anywhere(mem: pd.DataFrame, sid: str, *categories: str) -> float:
    """Max over ranks of these state categories' bytes, on the device and in host memory together: a run on a
    device records the host's share apart (harness.measure.census HOST_CATEGORIES), and state offloaded there
    is still held by the rank."""
    names = [f"state_{c}" for c in categories]
    if (sid, f"state_host_{categories[0]}") in _per_rank(mem):
        names += [f"state_host_{c}" for c in categories]
    return max_over_ranks(mem, sid, *names)


def offload_host(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Feature offload, on a device: after the step the device holds none of the rank's parameters,
    gradients and optimizer state, and host memory holds them, at least the ZeRO-3 ideal (nothing dropped on
    the way). A run without a device apart from the host (CPU, gloo) has nothing to offload from: SKIP."""
    out, mem = [], tables["memory"]
    for row in _measured_rows(tables, "offload_host", out).itertuples():
        if not has(feature_of(row), "offload"):
            continue
        if (row.scenario, "state_host_params") not in _per_rank(mem):
            out.append(
                Verdict(
                    "offload_host",
                    row.scenario,
                    SKIP,
                    None,
                    None,
                    message=(
                        "does not apply: the rank computes in host memory (a CPU run), so there is no device to offload "
                        "from; run with --backend nccl on a GPU"
                    ),
                )
            )
            continue
        ideal = _ideal_state(tables, row)
        if isinstance(ideal, str):
            out.append(not_measured("offload_host", row, ideal))
            continue
        device = max_over_ranks(mem, row.scenario, *(f"state_{c}" for c in STATE_CATEGORIES))
        host = max_over_ranks(mem, row.scenario, *(f"state_host_{c}" for c in STATE_CATEGORIES))
        want = float(sum(ideal.values()))
        kept = f"the device still holds {device:,.0f} B of them"
        if (
            device > 0
            and _root_kept_after_eval(row, max_over_ranks(mem, row.scenario, "state_params"))
            and device == max_over_ranks(mem, row.scenario, "state_params")
        ):
            kept += f" ({ROOT_AFTER_EVAL}: at most its {float(row.root_bytes):,.0f} B)"
        problems = ([kept] if device > 0 else []) + (
            [f"host memory holds only {host:,.0f} B of the ideal {want:,.0f} B"] if host < want else []
        )
        msg = (
            f"parameters, gradients and optimizer state after the step: {device:,.0f} B per rank on the device "
            f"(0 allowed), {host:,.0f} B in host memory (ideal {want:,.0f} B)"
        )
        out.append(
            judge(
                "offload_host",
                row,
                not problems,
                device,
                0.0,
                msg if not problems else f"{msg}; {'; '.join(problems)}",
                where="; ".join(problems),
            )
        )
    return out


def _offloaded(row) -> bool:
    return row.status == "ok" and has(feature_of(row), "offload")


def _root_kept_after_eval(row, excess: float) -> bool:
    """Feature eval: whether what a rank holds after the step exceeds its limit (in one category: the
    parameters, or memory outside them, where an implementation keeps a flat buffer) by no more than the
    root's own parameters in full, as an all-gather returns them: what an implementation that keeps the root
    gathered after the no_grad forward holds (harness/core/policy.py ROOT_AFTER_EVAL). The gathered buffer
    carries the shards' padding, up to W - 1 rows a tensor (gather_padding): FSDP2 keeps its padded all-gather
    output, of which the unsharded parameters are views, so a root whose rows W does not divide (a 7-row head at
    W = 2) holds more than its own bytes."""
    root = float(getattr(row, "root_bytes", math.nan))
    return has(feature_of(row), "eval") and root == root and 0 < excess <= root + gather_padding(row)


def _transient(mem: pd.DataFrame, sid: str) -> float:
    """What scenario `sid` held at its peak beside the state it keeps between steps, max over ranks: its
    activations and the backward's and the optimizer step's temporaries (a foreach optimizer's intermediates are
    the size of its state), whatever moment of the step the peak fell at."""
    per_rank = _per_rank(mem)
    peak, state = per_rank.get((sid, "peak")), per_rank.get((sid, "state_total"))
    if peak is None or state is None:
        return math.nan
    return float(max(max(0.0, peak[r] - state.get(r, 0.0)) for r in peak))


def peak_memory_bound(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Peak <= sharded state + one unit's unsharded params and grads (twice: prefetch/overlap) +
    measured activations and other, with a stated margin. Keeping every unit unsharded breaks it. Not for the
    plain model's runs: they are the yardsticks (a run held to its own peak would pass by construction), and a
    noise probe that is no run's yardstick measures no peak (Scenario.peak_is_read)."""
    out, mem = [], tables["memory"]
    for row in _measured_rows(tables, "peak_memory_bound", out, not_reference).itertuples():
        peak = max_over_ranks(mem, row.scenario, "peak")
        if math.isnan(peak):
            out.append(not_measured("peak_memory_bound", row, "the rank recorded no peak memory"))
            continue
        ideal = _ideal_state(tables, row)
        if isinstance(ideal, str):
            out.append(not_measured("peak_memory_bound", row, ideal))
            continue
        # two units' parameters and gradients gathered whole (the one computing and one prefetched), at any world
        # size: at one rank too an implementation may gather a unit into a buffer of its own
        unsharded = 2 * 2 * float(row.largest_unit_bytes) if "params" in partitioned(row) and row.sharded else 0
        # with the reduction switched off between micro-batches every unit's unsharded gradient is held
        held_grads = (
            float(row.trainable_bytes)
            if row.sharded and shards(row) > 1 and holds_unsharded_grads(Scenario.of_row(row).feature)
            else 0.0
        )
        # the compute copies where no unit is gathered: of every parameter (sharded W > 1: inside `unsharded`)
        copies = COMPUTE_COPY_RATIO.get(feature_of(row), 0.0) * float(row.param_bytes) if not unsharded else 0.0
        # what the step itself holds beside its state (activations, temporaries), measured on the plain model doing
        # the same step on the same samples: the run's yardstick (the full batch, or with split data the rank-order
        # micro-batch probe, whose micro-batches are the ranks' slices), so no implementation sets its own bound
        yardstick = split_yardstick(row)
        transient = _transient(mem, yardstick)
        if math.isnan(transient):
            out.append(
                not_measured("peak_memory_bound", row, f"no activations recorded for the plain model's {yardstick}")
            )
            continue
        kept = _kept_after_forward(row)
        bound = (sum(ideal.values()) + unsharded + held_grads + copies + kept + transient) * (
            1 + bounds.peak_slack
        ) + 4 * shard_padding(row, bounds)
        msg = (
            f"peak {peak:,.0f} B per rank vs bound {bound:,.0f} B (state ideal {sum(ideal.values()):,.0f} + "
            f"2 units unsharded {unsharded:,.0f} + the plain model's activations and temporaries {transient:,.0f}"
            + (f" + unsharded gradients held between micro-batches {held_grads:,.0f}" if held_grads else "")
            + (f" + {feature_of(row)} compute copies of the parameters {copies:,.0f}" if copies else "")
            + (f" + post-forward shards {kept:,.0f}" if kept else "")
            + f", +{bounds.peak_slack:.0%})"
        )
        out.append(
            _at_most(
                "peak_memory_bound", row, peak, bound, msg, f"params: peak exceeds the bound by {peak - bound:,.0f} B"
            )
        )
    return out


def peak_params_bound(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Sharded, W > 1: the parameters a rank holds at the step's peak <= its shards + two child
    units gathered (the one running and one prefetched) + the root's own parameters (FSDP2 keeps
    the root gathered between forward and backward), plus padding. Held apart from activations,
    which dominate the peak of a small model and would hide a whole extra copy of the parameters
    (an implementation that skips the reshard after forward fails here, not in peak_memory_bound)."""
    out, mem = [], tables["memory"]
    for row in _measured_rows(tables, "peak_params_bound", out, params_sharded).itertuples():
        held = max_over_ranks(mem, row.scenario, "params")
        if math.isnan(held) or math.isnan(float(getattr(row, "root_bytes", math.nan))):
            out.append(
                not_measured(
                    "peak_params_bound",
                    row,
                    "parameters at the peak or the root's own parameter bytes were not recorded",
                )
            )
            continue
        mine = -(-int(row.param_bytes) // shards(row))
        gathered = 2 * float(row.largest_child_bytes) + float(row.root_bytes)
        kept = _kept_after_forward(row)
        bound = (
            mine
            + gathered
            + kept
            + shard_padding(row, bounds)
            + 2 * bounds.align_bytes_per_tensor * float(row.param_tensors)
        )
        msg = (
            f"parameters held at the peak {held:,.0f} B per rank vs bound {bound:,.0f} B (shards {mine:,} + "
            f"2 child units {2 * float(row.largest_child_bytes):,.0f} + root {float(row.root_bytes):,.0f}"
            + (f" + post-forward shards {kept:,.0f}" if kept else "")
            + " + padding)"
        )
        out.append(
            _at_most(
                "peak_params_bound", row, held, bound, msg, f"params: {held - bound:,.0f} B over the bound at the peak"
            )
        )
    return out


def units_gathered(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Sharded, W > 1: at no moment of the measured step more units hold their full parameters than
    ZeRO-3 lets them (harness.measure.timeline.ALLOWED: 2 in forward and backward, the unit running
    and one prefetched; 1 between forward and backward; none after backward, the root included; under
    eval, 2 in its no_grad forward and none after it, the root aside).
    Counted in units, not bytes, so a unit left gathered after its forward fails on any model."""
    out, gathered = [], tables["gathered"]
    for row in _measured_rows(tables, "units_gathered", out, params_sharded).itertuples():
        g = gathered[gathered.scenario == row.scenario]
        phases = expected_phases(feature_of(row))
        missing = [p for p in phases if p not in set(g.phase)]
        if g.empty or missing:
            out.append(not_measured("units_gathered", row, f"no moments of {', '.join(missing)} recorded"))
            continue
        # blind only if no parameter was ever seen full either: an implementation that gathers finer than the
        # harness's units (DeepSpeed ZeRO-3 fetches and releases per leaf module until its trace is complete,
        # so without prefetching a block of several leaf modules is never whole at once) holds 0 units
        seen_params = "params" in g and g.params.astype(bool).any()
        if not (g.units.max() > 0 or g.root.astype(bool).any() or seen_params):
            out.append(
                not_measured(
                    "units_gathered",
                    row,
                    "no unit was ever seen holding its full parameters: "
                    "the implementation keeps them where the model's modules do not point",
                )
            )
            continue
        problems, worst, root_after_eval, first_rank = [], 0, 0, None
        for r in g.itertuples():
            units_over = int(r.units) - ALLOWED[r.phase]
            root_kept = bool(r.root) and r.phase not in ROOT_FREE
            worst = max(worst, units_over + int(root_kept))
            at = f"{r.phase.replace('_', ' ')} on rank {r.rank}"
            if units_over > 0:
                problems.append(f"{at}: {int(r.units)} units gathered at once ({r.which}), {ALLOWED[r.phase]} allowed")
            if root_kept:
                problems.append(f"{at}: the root's own parameters still gathered")
                root_after_eval += r.phase == "after_eval"
            if problems and first_rank is None:
                first_rank = int(r.rank)
        if problems and root_after_eval == len(problems):  # one cause, named as such (policy: ROOT_AFTER_EVAL)
            problems[0] += f" ({ROOT_AFTER_EVAL}, on {len(problems)} ranks)"
        most = g.groupby("phase").units.max()
        msg = (
            "most units gathered at once: "
            + ", ".join(f"{p.replace('_', ' ')} {int(most[p])}" for p in phases)
            + " (allowed "
            + ", ".join(str(ALLOWED[p]) for p in phases)
            + "; the root may stay gathered until "
            "backward ends" + (" and during the eval forward" if "eval" in phases else "") + ")"
        )
        out.append(
            judge(
                "units_gathered",
                row,
                not problems,
                worst,
                0,
                msg if not problems else f"{msg}; {problems[0]}",
                where="; ".join(problems[:3]),
                rank=first_rank,
            )
        )
    return out


def comm_volume(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Sharded, W > 1, per step, counted in elements so that the element type neither hides nor
    fakes volume: parameter all-gathers at most 2P elements, and the gradient reduction exactly the
    trainable elements T (P when nothing is frozen: a frozen parameter is gathered, never reduced)
    by a reduce-scatter, an all-to-all, or reduces or gathers to each part's owner. An all-reduce
    hands every rank the whole reduced gradient (DDP style): twice a reduce-scatter's ring traffic, so it fails here whatever its
    bytes. The bytes follow from the element types: a reduction in a wider type than the
    parameters (float64, exact by design) is reported with its traffic factor, not failed."""
    out, comm = [], tables["comm"]
    for row in _measured_rows(tables, "comm_volume", out, _ok_multi_rank).itertuples():
        c = comm[comm.scenario == row.scenario]
        elements = c.groupby("collective")["elements"].sum().to_dict()
        nbytes = c.groupby("collective")["bytes"].sum().to_dict()
        p = float(row.param_elements)
        width = float(row.param_bytes) / p  # bytes per parameter element
        ideal = ideal_comm_elements(int(p), shards(row), int(row.trainable_elements))
        feature = Scenario.of_row(row).feature  # each micro-batch gathers; each reduces unless switched off
        passes, reductions = passes_per_step(feature), reductions_per_step(feature)
        # eval: one more forward per step, under no_grad: one more all-gather of the parameters (P)
        evals = 1 if has(feature, "eval") else 0
        ideal_gather = (passes + evals / 2) * float(ideal["all_gather"])
        # ZeRO-1 and 2 keep the parameters whole: each rank gathers the updated ones once, after the step
        state = partitioned(row)
        if "params" not in state:
            ideal_gather, evals = p, 0
        t = reductions * float(ideal["reduce_scatter"])
        allowance = passes * gather_padding(row, bounds) / width
        gather_allowance = 2 * allowance + evals * gather_padding(row, bounds) / width
        gather = elements.get("all_gather", 0.0)
        scatter = _reduced(elements, shards(row))
        all_reduce = elements.get("all_reduce", 0.0)
        # clipping all-reduces the global gradient norm, and a user's optimizer may all-reduce a whole-matrix
        # norm ([Note: user optimizer]): a few elements (at most one per parameter tensor) a step each, not
        # the gradient; anything beyond that counts as a gradient all-reduce
        norms = (clip_of(feature) is not None) + user_optimizer(row.optimizer)
        # (at most what leaves the gradient's own reduction whole: a one-element norm beside a gradient all-reduce)
        whole = float(ideal["reduce_scatter"]) * (1 if "grads" not in partitioned(row) else reductions)
        norm_reduce = min(all_reduce, norms * float(row.param_tensors), max(0.0, scatter + all_reduce - whole))
        whose = " and ".join(
            w for w, on in (("clipping", clip_of(feature)), ("optimizer", user_optimizer(row.optimizer))) if on
        )
        all_reduce -= norm_reduce
        # hybrid sharding: the replicas then average their reduced shards, T / S elements of the rank's
        # own, by an all-reduce (FSDP2) or any of the reductions above
        # (an all-reduce may be written as a reduce-scatter and an all-gather of the reduced parts: that
        # all-gather is allowed beside the parameters')
        replicas_t = t / shards(row) if has(feature, "hsdp") else 0.0
        replica_reduce = min(all_reduce, replicas_t * (1 + bounds.comm_slack) + allowance / shards(row))
        t += replicas_t
        ideal_gather += replicas_t
        reduce = scatter + all_reduce
        reduce_bytes = _reduced(nbytes, shards(row)) + nbytes.get("all_reduce", 0.0) * (
            all_reduce / (all_reduce + norm_reduce) if all_reduce else 0
        )
        factor = reduce_bytes / (reduce * width) if reduce else math.nan
        types = sorted(set(c[c.collective.isin((*SCATTER_COLLECTIVES, "all_reduce"))].dtype.astype(str)))
        problems = []
        per, per_r = (f"{n} x " if n > 1 else "" for n in (passes, reductions))  # passes, reductions per step
        plus_eval = " + P (the eval forward)" if evals else ""
        if gather > ideal_gather * (1 + bounds.comm_slack) + gather_allowance:
            problems.append(f"all_gather {gather:,.0f} elements > {per}2P{plus_eval} = {ideal_gather:,.0f}")
        # reshard2: after forward each unit is spread over groups of g ranks, and backward regathers it within
        # its group: the all-gathers over the whole shard group are forward's (and eval's), P a pass, no more
        g = post_forward_ranks(feature, int(row.world_size))
        regather = _gathered_over(c, g) if 1 < g < shards(row) else 0.0
        wide = gather - regather
        if 1 < g < shards(row) and wide > (passes + evals) * p * (1 + bounds.comm_slack) + gather_allowance / 2:
            problems.append(
                f"all_gather over {shards(row)} ranks {wide:,.0f} elements > {per}P{plus_eval} = "
                f"{(passes + evals) * p:,.0f}: reshard_after_forward={g} regathers backward's "
                f"parameters within groups of {g} ranks, yet {regather:,.0f} elements were gathered so"
            )
        # a whole gradient (ZeRO-1's) may be accumulated over the micro-batches and reduced once, at the last
        t_least = t / reductions if "grads" not in state else t
        # hybrid sharding: the replicas average their padded shards, 1/S of the padded gradient more
        reduce_allowance = allowance * (1 + 1 / shards(row)) if replicas_t else allowance
        if not t_least <= reduce <= t * (1 + bounds.comm_slack) + reduce_allowance:
            what = "trainable" if t != reductions * p else "P ="
            problems.append(f"gradient reduction {reduce:,.0f} elements != {per_r}{what} {t:,.0f}")
        if all_reduce > replica_reduce and "grads" in state:  # ZeRO-1 keeps the gradient whole: its own reduction
            problems.append(
                f"gradients reduced by all_reduce ({all_reduce:,.0f} elements): every rank receives the "
                "whole reduced gradient, twice a reduce-scatter's traffic (not ZeRO-3)"
            )
        msg = (
            f"per step: all_gather {gather:,.0f} elements ({gather / p:.2f}P), gradient reduction "
            f"{reduce:,.0f} elements ({reduce / p:.2f}P) in {', '.join(types) or 'no type'}, "
            f"{reduce_bytes:,.0f} B: traffic factor {factor:.2f}x the parameters' {8 * width:g}-bit elements; "
            f"ZeRO-3 ideal {per}2P{plus_eval} + {per_r}P with P = {p:,.0f} elements"
            + (f"; the {whose} norm's all_reduce {norm_reduce:,.0f} elements" if norm_reduce else "")
            + (f"; the replicas' average of their shards T/S = {replicas_t:,.0f} elements" if replicas_t else "")
            + (
                f"; all_gather within groups of {g} ranks (backward's regather) {regather:,.0f} elements"
                if 1 < g < shards(row)
                else ""
            )
        )
        limit = (
            (ideal_gather + t) * (1 + bounds.comm_slack) + gather_allowance + allowance
        )  # the most both conditions above allow together
        out.append(
            judge(
                "comm_volume",
                row,
                not problems,
                (gather + reduce) / p,
                limit / p,
                msg + f"; allowed up to {limit / p:.3g}P with padding",
                where="; ".join(problems),
            )
        )
    return out


def _kept_after_forward(row) -> float:
    """reshard2: bytes a rank holds between a unit's forward and its backward beyond its shards, every unit
    at once (after the last forward): each keeps 1 / g of its parameters (padded) beside its own 1 / S shard,
    so param_bytes / g + its padding more ([Note: reshard2] in harness/core/policy.py); 0 otherwise."""
    s, g = shards(row), post_forward_ranks(feature_of(row), int(row.world_size))
    return (float(row.param_bytes) / g + shard_padding(row)) if row.sharded and g < s else 0.0


def _gathered_over(c, ranks: int) -> float:
    """Elements all-gathered over groups of `ranks` ranks in a scenario's comm rows (0 for a table stored
    before the group size was recorded)."""
    if "ranks" not in c:
        return 0.0
    return float(c[(c.collective == "all_gather") & (c["ranks"] == ranks)].elements.sum())


def _ok_multi_rank(row) -> bool:
    """Completed, sharded, and each parameter really split: over more than one rank."""
    return row.status == "ok" and bool(row.sharded) and shards(row) > 1


def partitioned(row) -> tuple[str, ...]:
    """The training state the row's implementation partitions (scenarios.sharded_state; a run stored before the
    column existed: all of it when sharded, ZeRO-3)."""
    value = getattr(row, "sharded_state", None)
    if not isinstance(value, str):
        return STATE_CATEGORIES if bool(getattr(row, "sharded", True)) else ()
    return tuple(v for v in value.split(",") if v)


def params_sharded(row) -> bool:
    return _ok_multi_rank(row) and "params" in partitioned(row)


_SIZES = ("scenario", "status", "world_size", "sharded", "optimizer", "param_bytes", "row_bytes", "param_tensors")
_MEM = {"memory": ("scenario", "category", "bytes")}
RESOURCE_CHECKS = (
    Check(memory_sharding, ok_row, {"scenarios": _SIZES, **_MEM}, kind="efficiency"),
    Check(
        peak_memory_bound,
        not_reference,
        {"scenarios": _SIZES + ("largest_unit_bytes", "trainable_bytes"), **_MEM},
        kind="efficiency",
    ),
    Check(
        peak_params_bound,
        params_sharded,
        {"scenarios": _SIZES + ("largest_child_bytes", "root_bytes"), **_MEM},
        kind="efficiency",
    ),
    Check(
        units_gathered,
        params_sharded,
        {"scenarios": _SIZES, "gathered": ("scenario", "rank", "phase", "units", "which", "root")},
        kind="efficiency",
    ),
    Check(offload_host, _offloaded, {"scenarios": _SIZES, **_MEM}, kind="efficiency"),
    Check(
        comm_volume,
        _ok_multi_rank,
        {
            "scenarios": _SIZES + ("param_elements", "trainable_elements"),
            "comm": ("scenario", "collective", "dtype", "elements", "bytes"),
        },
        kind="efficiency",
    ),
)
