"""The parent side of the localiser: where a run and its yardstick parted, from their ranks' traces.

How each phase is mapped (a rank of the run under test against the yardstick, the plain model in one
process; harness.localize.replay says which one):

- parameters at the start of a step (initial parameters; the checkpoint load of a resumed run): the
  rows of each parameter the rank holds against the same rows of the yardstick's, bit for bit;
- forward, recomputation and backward: op by op. With replicated data a rank computes what the
  yardstick computes (same parameters, same batch); with split data rank r's pass j is the yardstick's
  pass r x k + j (the yardstick sums the ranks' slices as micro-batches). The yardstick's ops of a
  module must appear, in order and bit for bit, among the rank's ops of that module (an implementation
  adds ops of its own: gathers, copies, hooks); the first that does not is where they parted. A
  recomputed forward (activation checkpointing) is held to the yardstick's forward of the same module.
  The yardstick's ops on parameters alone (its bf16 casts, a transpose) and the backward of the autograd
  nodes they made (phase "parameter preparation", trace.py) are not held: how parameters are prepared is
  the implementation's own;
- the gradient after the backward and the reduction, after clipping, and the parameters after the
  optimizer step: the rows the rank holds against the yardstick's rows. A reduction adds the ranks'
  gradients in an order of its own, so a difference no larger than the rounding of summing those n
  terms in another order (2 (n-1) u sum|g_i| per element, u the unit roundoff of fp32, the terms read
  from the yardstick's gradient after each pass) is named as such: the runs part there by rounding
  alone (the yardstick starts the next step from the run's parameters, so its forward and backward are
  compared bit for bit again);
- the optimizer step: the yardstick's optimizer steps on the gradients the run applied (assembled from its
  ranks' rows) from the run's own parameters, so its state follows the run's gradients and the updates
  must agree bit for bit at every step, after a reduction's rounding too (the optimizer's math is
  elementwise: sharding changes none of it); a resumed run's state is its saver's and is compared only
  until its runs part;
- nothing else: the optimizer's own ops run on shards against full tensors and are not compared op by
  op; a parameter a rank holds other than as dim-0 rows of the full tensor (a flat buffer) is named as
  having no mapping.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

U32 = 2.0**-24  # unit roundoff of fp32
STATE_SLOTS = {
    "grads_reduced": (1000, "gradient reduction"),
    "grads_clipped": (1001, "clipping"),
    "params_after": (1002, "optimizer step"),
}


@dataclass
class Point:
    """Where a rank parted from the yardstick."""

    step: int
    slot: int  # order within the step
    phase: str
    module: str
    op: str
    detail: str  # the element: where, both values, their distance
    pass_: int | None = None
    rounding: bool = False  # within the rounding a reduction's order may add
    context: list = field(default_factory=list)  # (yardstick op, rank op) lines around the point
    ranks: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.step, self.slot, self.phase, self.module, self.op)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance of two fp32 tensors in units in the last place (on the integer line of fp32 values)."""

    def line(t):
        i = t.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)

    return (line(a) - line(b)).abs()


def element(name: str, here: torch.Tensor, there: torch.Tensor, row0: int = 0) -> tuple[str, int]:
    """The element where two tensors of one shape differ most: '<name>[i, j] (flat f): a here, b in the
    yardstick, N ulps; m of n elements differ', and its index."""
    if here.shape != there.shape:
        return f"{name}: shape {list(here.shape)} here, {list(there.shape)} in the yardstick", -1
    a, b = here.reshape(-1).double(), there.reshape(-1).double()
    diff = (a - b).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    differ = (
        int((here.reshape(-1) != there.reshape(-1)).sum())
        if not here.is_floating_point()
        else int(((a != b) & ~(torch.isnan(a) & torch.isnan(b))).sum())
    )
    flat = int(diff.argmax())
    idx = list(torch.unravel_index(torch.tensor(flat), here.shape)) if here.dim() else []
    idx = [int(i) for i in idx]
    if idx:
        idx[0] += row0
    where = f"{name}[{', '.join(map(str, idx))}]" if idx else name
    dist = ""
    if here.is_floating_point():
        dist = (
            f", {int(ulps(here.reshape(-1)[flat : flat + 1].float(), there.reshape(-1)[flat : flat + 1].float()))} ulps"
        )
    return (
        f"{where}: {float(a[flat]):.9g} here, {float(b[flat]):.9g} in the yardstick{dist}; "
        f"{differ} of {a.numel()} elements differ"
    ), flat


# ---------------------------------------------------------------------------------------------- ops ---
def _ops(trace: dict, step: int, pass_: int, phases, prep: bool = True) -> list[dict]:
    """The step's ops of pass `pass_` in `phases` that have a value; without the parameters' preparation
    (ops on parameters alone: trace.StepTracer._from_params) unless `prep`."""
    return [
        o
        for o in trace["ops"]
        if o["step"] == step
        and o["pass"] == pass_
        and o["phase"] in phases
        and o.get("digest") is not None
        and (prep or not o.get("prep"))
    ]


def first_unmatched(ref_ops: list[dict], ops: list[dict]):
    """The yardstick's first op that the rank's ops of the same module do not contain in order, bit for
    bit, with the rank's op that stands in its place (the next of that op and shape), or None."""
    by_module = defaultdict(list)
    anywhere = defaultdict(list)  # (op, digest) -> the rank's ops, for those an implementation runs elsewhere
    for o in ops:
        by_module[o["module"]].append(o)
        anywhere[(o["op"], o["digest"], str(o["shape"]))].append(o)
    pos, used, matched = defaultdict(int), set(), {}
    for r in ref_ops:
        seq, i = by_module[r["module"]], pos[r["module"]]
        while i < len(seq) and (
            seq[i]["i"] in used
            or not (seq[i]["op"] == r["op"] and seq[i]["digest"] == r["digest"] and seq[i]["shape"] == r["shape"])
        ):
            i += 1
        if i < len(seq):
            used.add(seq[i]["i"])
            matched[r["i"]] = seq[i]
            pos[r["module"]] = i + 1
            continue
        # an op the implementation runs in another module's hooks (a cast of the parameters for mixed
        # precision, made by its pre-forward hook where the plain model casts before the call)
        elsewhere = next((o for o in anywhere[(r["op"], r["digest"], str(r["shape"]))] if o["i"] not in used), None)
        if elsewhere is not None:
            used.add(elsewhere["i"])
            matched[r["i"]] = elsewhere
            continue
        start = pos[r["module"]]
        cand = next((o for o in seq[start:] if o["op"] == r["op"] and o["shape"] == r["shape"]), None)
        after = seq[seq.index(cand) + 1 :] if cand is not None else seq[start:]
        return r, cand, (matched, after)
    return None


def _op_point(step, slot, phase, pass_, ref_trace, trace, ref_ops, ops, found) -> Point:
    r, cand, (matched, after) = found
    nth = sum(1 for o in ref_ops if o["module"] == r["module"] and o["op"] == r["op"] and o["i"] < r["i"])
    op = f"{r['op']} (call {nth + 1} of that op in {r['module']}), output {r['shape'][0] if r['shape'] else []}"
    if cand is None:
        detail = "the rank ran no such op in this module where the yardstick did"
    else:
        mine, theirs = trace["values"].get(cand["i"]), ref_trace["values"].get(r["i"])
        detail = (
            element("output", mine, theirs)[0]
            if mine is not None and theirs is not None
            else "values not kept (over the trace's keep_bytes): the op's output hashes differ"
        )
    seq = [o for o in ref_ops if o["module"] == r["module"]]
    at = seq.index(r)
    name = lambda o: f"{o['op']} {o['shape'][0] if o['shape'] else ''}".strip()  # noqa: E731
    context = [(name(o), name(matched[o["i"]]) if o["i"] in matched else "", "same") for o in seq[max(0, at - 3) : at]]
    context.append((name(r), name(cand) if cand is not None else "(none)", "DIFFERS"))
    context += [
        (name(o), name(mine) if mine is not None else "", "")
        for o, mine in zip(seq[at + 1 : at + 4], after[:3] + [None] * 3)
    ]
    return Point(step, slot, phase, r["module"], op, detail, pass_=pass_, context=context)


# -------------------------------------------------------------------------------------------- state ---
def _state(trace: dict, step: int, what: str) -> dict | None:
    return next((s["params"] for s in trace["state"] if s["step"] == step and s["what"] == what), None)


def _terms(ref_trace: dict, step: int) -> dict[str, torch.Tensor]:
    """Per parameter, sum |g_i| over the yardstick's pass gradients of the step (its gradient after each
    pass minus the one before), and the number of terms."""
    snaps = [s["params"] for s in ref_trace["state"] if s["step"] == step and s["what"] == "grads_pass"]
    snaps.append(_state(ref_trace, step, "grads_reduced") or {})
    out = {}
    for name in snaps[-1]:
        prev, total = None, None
        for snap in snaps:
            g = snap.get(name, (None, None))[1]
            if g is None:
                continue
            term = (g.double() - (prev if prev is not None else 0)).abs()
            total = term if total is None else total + term
            prev = g.double()
        out[name] = total
    return out


def unit_of(name: str, units: list[str]) -> str:
    """The deepest unit whose module holds parameter `name` ('(root)' for the root's own)."""
    owners = [u for u in units if name.startswith(u + ".")]
    return max(owners, key=len) if owners else "(root)"


def compare_state(mine: dict, ref: dict, allowance: dict | None = None, what: str = "parameter"):
    """The first parameter (in the yardstick's order) whose rows the rank holds differ from the
    yardstick's, that it lacks, or whose padding rows (beyond the rows it holds) are not zero: (name,
    detail, within allowance), or None; `allowance`: name -> per-element bound."""
    for name, (_, full) in ref.items():
        if name not in mine:
            return name, f"{name}: the rank holds no {what} of it where the yardstick has one", False
        rows, local = mine[name]
        if rows is not None and local.dim() and local.shape[0] > rows[1] - rows[0]:
            pad = local[rows[1] - rows[0] :]
            if bool((pad != 0).any()):
                at = int((pad != 0).reshape(pad.shape[0], -1).any(1).nonzero()[0])
                return (
                    name,
                    (
                        f"{name}: padding row {at} beyond the {rows[1] - rows[0]} rows the rank holds is "
                        f"not zero ({float(pad[at].reshape(-1)[0]):.9g}, ...)"
                    ),
                    False,
                )
        if rows is not None:
            theirs, row0 = full[rows[0] : rows[1]], rows[0]
        elif local.shape == full.shape:
            theirs, row0 = full, 0
        else:
            return (
                name,
                (f"{name}: held as {list(local.shape)}, not as dim-0 rows of the full {list(full.shape)}: no mapping"),
                False,
            )
        if local.shape != theirs.shape:
            local = local[: theirs.shape[0]] if local.dim() and local.shape[1:] == theirs.shape[1:] else local
        if theirs.device != local.device:  # state offloaded to the host against the yardstick's on the device
            theirs = theirs.to(local.device)
        if local.shape == theirs.shape and torch.equal(local, theirs):
            continue
        detail, flat = element(name, local, theirs, row0)
        within = False
        if allowance is not None and name in allowance and local.shape == theirs.shape and flat >= 0:
            bound = allowance[name]
            bound = bound[row0 : row0 + theirs.shape[0]] if rows is not None else bound
            within = bool(((local.double() - theirs.double()).abs() <= bound.reshape(local.shape)).all())
        return name, detail, within
    return None


# ------------------------------------------------------------------------------------------- a rank ---
def first_point(
    ref: dict,
    mine: dict,
    *,
    rank: int,
    world_size: int,
    split: bool,
    passes: int,
    steps: list[int],
    resumed_at: int = 0,
    carried: bool = False,
) -> Point | None:
    """Where rank `rank`'s trace `mine` first parts from the yardstick's `ref` beyond rounding; else the
    first place they part by a reduction's rounding alone (Point.rounding), or None. The yardstick starts
    each step after the first from the parameters the run holds (replay.assemble), so a step is compared
    from the same parameters even after an earlier step's rounding, and its optimizer steps on the run's
    own gradients (replay.replay, StepTracer.force_grads), so the optimizer's update is compared bit for bit
    at every step, after rounding too (its state follows the run's); without forced gradients only while
    nothing has been rounded apart (its state would carry the rounding); `carried`: a resumed run's
    checkpoint came from a trajectory the yardstick's differs from by rounding (another world size), so its
    updates are not compared from the start."""
    units = ref.get("units", [])
    rounded, apart, steady = None, carried, None
    for step in steps:
        before = compare_state(
            _state(mine, step, "params_before") or {}, _state(ref, step, "params_before") or {}, what="parameter"
        )
        if before is not None:
            phase = (
                "checkpoint load"
                if resumed_at and step == resumed_at + 1
                else "initial parameters"
                if step == 1
                else "parameters at the start of the step"
            )
            return Point(step, 0, phase, unit_of(before[0], units), "(parameters held)", before[1])
        for j in range(passes):
            found = _pass_point(ref, mine, step, j, rank * passes + j if split else j)
            if found is not None:
                return found
        terms = _terms(ref, step)
        n = world_size * passes
        allowance = {k: 2 * max(n - 1, 0) * U32 * v for k, v in terms.items() if v is not None}
        # the parameters whose gradients the yardstick's optimizer took from the run at every step so far: its
        # state then follows the run's, and their update is compared bit for bit even after rounding apart
        forced = set(ref.get("forced", {}).get(step, ()))
        steady = forced if steady is None else steady & forced
        for what in ("grads_reduced", "grads_clipped", "params_after"):
            theirs, ours = _state(ref, step, what), _state(mine, step, what)
            if theirs is not None and what == "params_after" and apart:
                # and those without a gradient, which no optimizer moves
                held = (steady or set()) | (set(theirs) - set(_state(ref, step, "grads_reduced") or ()))
                theirs = {k: v for k, v in theirs.items() if k in held} if not carried else None
            if not theirs or ours is None:
                continue
            slot, phase = STATE_SLOTS[what]
            bound = (
                allowance
                if what == "grads_reduced"
                else (
                    {
                        k: v + 2 * (world_size + 2) * U32 * theirs[k][1].double().abs()
                        for k, v in allowance.items()
                        if k in theirs
                    }
                    if what == "grads_clipped"
                    else None
                )
            )
            found = compare_state(ours, theirs, bound, what="gradient" if what.startswith("grads") else "parameter")
            if found is None:
                continue
            name, detail, within = found
            op = (
                _reduction_op(mine, step, unit_of(name, units))
                if what == "grads_reduced"
                else "the clipping coefficient applied"
                if what == "grads_clipped"
                else "the optimizer's update"
            )
            point = Point(step, slot, phase, unit_of(name, units), op, detail, rounding=within)
            if not within:
                return point
            rounded, apart = rounded or point, True
    return rounded


def _reduction_op(trace: dict, step: int, unit: str) -> str:
    """The reduction collectives the rank issued for `unit` in the step (by the module whose backward issued
    them), or what it issued at all; "no collective" where it reduced nothing (one rank)."""
    sent = [o for o in trace["ops"] if o["step"] == step and o.get("sent")]
    mine = [o for o in sent if o["module"] == unit or o["module"].startswith(unit + ".")] if unit != "(root)" else []
    chosen = mine or sent
    if not chosen:
        return "the gradient as the backward left it (no reduction collective ran)"
    kinds = sorted({o["op"] for o in chosen})
    where = f"issued in {unit}'s backward" if mine else "issued in the step"
    return f"the gradient reduction: {', '.join(kinds)} x{len(chosen)} {where}"


def _pass_point(ref: dict, mine: dict, step: int, j: int, r_pass: int) -> Point | None:
    """The first op of the rank's pass `j` (the yardstick's pass `r_pass`) that parts from the yardstick's:
    forward, then a recomputation (held to the yardstick's forward of the modules recomputed), then
    backward."""
    for slot, phase, ref_phases, my_phases in (
        (1, "forward", ("forward",), ("forward",)),
        (2, "recomputation", ("forward",), ("recomputation",)),
        (3, "backward", ("backward",), ("backward",)),
    ):
        ops = _ops(mine, step, j, my_phases)
        if not ops and phase == "recomputation":
            continue
        ref_ops = _ops(ref, step, r_pass, ref_phases, prep=False)
        if phase == "recomputation":  # only the modules recomputed
            ref_ops = [o for o in ref_ops if o["module"] in {p["module"] for p in ops}]
        found = first_unmatched(ref_ops, ops)
        if found is not None:
            return _op_point(step, 1 + 3 * j + slot, phase, j, ref, mine, ref_ops, ops, found)
    return None


def reduction_rank(traces: list[dict], step: int) -> int | None:
    """Replicated data: the rank whose inputs to the step's reductions differ from every other rank's
    (which agree among themselves), or None."""
    sent = [[o["sent"] for o in t["ops"] if o["step"] == step and o.get("sent")] for t in traces]
    if len(sent) < 3:
        return None
    odd = [r for r in range(len(sent)) if all(sent[r] != sent[q] for q in range(len(sent)) if q != r)]
    agree = [r for r in range(len(sent)) if r not in odd]
    return odd[0] if len(odd) == 1 and all(sent[a] == sent[agree[0]] for a in agree) else None


def localise(
    ref: dict,
    traces: list[dict],
    *,
    split: bool,
    passes: int,
    steps: list[int],
    resumed_at: int = 0,
    carried: bool = False,
) -> Point | None:
    """The earliest point over the ranks where the run parted from its yardstick, with every rank that
    parted there (Point.ranks), or None when every traced step matches."""
    points = {}
    for rank, mine in enumerate(traces):
        p = first_point(
            ref,
            mine,
            rank=rank,
            world_size=len(traces),
            split=split,
            passes=passes,
            steps=steps,
            resumed_at=resumed_at,
            carried=carried,
        )
        if p is not None:
            points[rank] = p
    if not points:
        return None
    real = [p for p in points.values() if not p.rounding]
    first = min(real or points.values(), key=lambda p: (p.step, p.slot))
    first.ranks = [r for r, p in points.items() if p.key == first.key and p.rounding == first.rounding]
    if first.phase == "gradient reduction" and not split:
        odd = reduction_rank(traces, first.step)
        if odd is not None:
            first.detail += f"; rank {odd} put a different gradient into the reduction than the other ranks"
    return first
