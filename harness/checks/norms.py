"""Checks on gradient norms: the norm the harness measures at step 1 against the plain model's, and
the norm a clipping feature reports (the other checks hold every feature the same way, against the
plain model doing the same thing).

clip_acts (features clip, clip_inf): clipping that never acts cannot be wrong, so first every step's norm
before clipping must exceed the max norm (the reference's too: it is the yardstick); then the norm the
implementation's clip_grad_norm reports at step 1 must be the plain model's within the same relative
bound as grad_norm_matches: a norm computed on a rank's own shard (off by about sqrt(W) for L2) fails
here at step 1, naming it, besides the parameters it then clips wrongly.
"""

from __future__ import annotations

import math

from harness.checks.common import ROW, Check, fmt, judge, not_measured, not_reference, ok_rows, reference_id
from harness.checks.noise_floor import probe_cause, split_yardstick
from harness.core.features import clip_of
from harness.core.policy import Bounds
from harness.core.scenario import REFERENCE_IMPL, Scenario, widest
from harness.core.verdict import Verdict


def grad_norm_matches(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    """Step 1's global gradient norm equals the non-sharded model's within a relative bound.

    At step 1 every implementation starts from the same parameters and sees the same global batch,
    so its averaged gradient differs from the plain model's by rounding only (what it measured:
    reports/measured_behaviour.md#step-1s-gradient-norm). Parameters alone miss gradient faults that no
    optimizer step shows, such as junk in the padding of a flat shard; the norm reads the whole local
    gradient."""
    out, bound = [], bounds.grad_norm_rel
    sc, steps = tables["scenarios"], tables["steps"]
    first = (
        {r.scenario: (int(r.step), r.grad_norm) for r in steps[steps.step == steps.step.min()].itertuples()}
        if len(steps)
        else {}
    )
    pre_clip = (
        {r.scenario: getattr(r, "clip_norm", math.nan) for r in steps[steps.step == steps.step.min()].itertuples()}
        if len(steps)
        else {}
    )
    for row in ok_rows(sc)[lambda d: d.impl != REFERENCE_IMPL].itertuples():
        ref_id = split_yardstick(row)
        if ref_id not in first or row.scenario not in first:
            missing = ref_id if ref_id not in first else row.scenario
            out.append(not_measured("grad_norm_matches", row, f"no step-1 gradient norm of {missing}", bound))
            continue
        (step, got), (_, ref) = first[row.scenario], first[ref_id]
        if not math.isfinite(ref) or ref == 0:
            out.append(not_measured("grad_norm_matches", row, f"the reference's step-1 gradient norm is {ref}", bound))
            continue
        clip = clip_of(Scenario.of_row(row).feature)
        clipped_by_engine = bool(getattr(row, "engine_clips", False)) and clip is not None
        if clipped_by_engine:  # the norm the engine applied, after its clipping: the plain model's, clipped
            ref = ref * clip_coefficient(pre_clip.get(ref_id, math.nan), clip[1])
        rel = abs(got - ref) / abs(ref) if math.isfinite(got) else math.inf
        passed = rel <= bound
        msg = (
            f"step-1 gradient norm {got:.9g} vs non-sharded {ref:.9g}: relative difference {fmt(rel)} "
            f"(bound {bound:g}){ratio_hint(got, ref, widest(row), passed)}"
        )
        if ref_id != reference_id(row):
            msg += f"; against {ref_id}: {probe_cause(row)}"
        if clipped_by_engine:
            msg += (
                "; both after clipping to max_norm "
                f"{clip[1]:g}: the implementation clips inside its own step, where the harness reads the gradient"
            )
        out.append(judge("grad_norm_matches", row, passed, rel, bound, msg, step=step, param="gradient norm"))
    return out


# what a norm off by a factor of the world size most likely means, by the factor
_RATIO_CAUSES = (
    (lambda w: w, "W", "a sum over the ranks instead of a mean?"),
    (lambda w: 1 / w, "1/W", "divided by W twice, or one rank's part alone?"),
    (lambda w: math.sqrt(w), "sqrt(W)", "a norm summed over ranks that each hold the whole gradient?"),
    (lambda w: 1 / math.sqrt(w), "1/sqrt(W)", "a norm taken over the rank's own shard only?"),
)


def ratio_hint(got: float, want: float, world_size: int, passed: bool) -> str:
    """'; ratio 2.0 = W (a sum over the ranks instead of a mean?)' where a failed norm is the expected one
    times a factor of the world size (within 1%), else ''."""
    if passed or world_size < 2 or not (math.isfinite(got) and math.isfinite(want)) or want == 0 or got == 0:
        return ""
    ratio = got / want
    for factor, name, cause in _RATIO_CAUSES:
        if abs(ratio / factor(world_size) - 1) <= 0.01:
            return f"; ratio {ratio:.4g} = {name} at W = {world_size} ({cause})"
    return ""


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What torch.nn.utils.clip_grad_norm_ scales a gradient of pre-clip norm `norm` by: min(1, max_norm /
    (norm + 1e-6))."""
    return min(1.0, max_norm / (norm + 1e-6))


def clip_acts(tables, bounds: Bounds = Bounds()) -> list[Verdict]:
    out = []
    sc, steps = tables["scenarios"], tables["steps"]
    norms = {s: g.sort_values("step") for s, g in steps.groupby("scenario")} if len(steps) else {}
    for row in sc[sc.status == "ok"].itertuples():
        clip = clip_of(Scenario.of_row(row).feature)
        if clip is None:
            continue
        norm_type, max_norm = clip
        mine = norms.get(row.scenario)
        if bool(getattr(row, "engine_clips", False)):
            out.append(_clipped_by_engine(row, mine, norm_type, max_norm))
            continue
        if mine is None or "clip_norm" not in mine or mine.clip_norm.isna().any():
            out.append(not_measured("clip_acts", row, "no norm before clipping recorded at every step"))
            continue
        idle = mine[~(mine.clip_norm > max_norm)]
        kind = "L2" if norm_type == 2 else "infinity"
        if len(idle):
            first = idle.iloc[0]
            out.append(
                judge(
                    "clip_acts",
                    row,
                    False,
                    float(first.clip_norm),
                    max_norm,
                    f"the {kind} norm before clipping is {first.clip_norm:.6g} at step {int(first.step)}, "
                    f"not above max_norm {max_norm:g}: clipping did not act, so nothing about it was tested",
                    step=int(first.step),
                    param="gradient norm",
                    where="clipping did not act",
                )
            )
            continue
        if row.impl == REFERENCE_IMPL:
            out.append(
                judge(
                    "clip_acts",
                    row,
                    True,
                    float(mine.clip_norm.min()),
                    max_norm,
                    f"clipping acted at every step ({kind} norm {mine.clip_norm.min():.6g} at the least, "
                    f"max_norm {max_norm:g})",
                )
            )
            continue
        ref_id = split_yardstick(row)
        ref = norms.get(ref_id)
        if ref is None or "clip_norm" not in ref or ref.clip_norm.isna().all():
            out.append(not_measured("clip_acts", row, f"no norm before clipping of {ref_id}"))
            continue
        got, want = float(mine.clip_norm.iloc[0]), float(ref.clip_norm.iloc[0])
        rel = abs(got - want) / abs(want)
        step = int(mine.step.iloc[0])
        msg = (
            f"clipping acted at every step; the {kind} norm before clipping at step {step} is {got:.9g} vs "
            f"the plain model's {want:.9g}: relative difference {fmt(rel)} "
            f"(bound {bounds.grad_norm_rel:g}){ratio_hint(got, want, widest(row), rel <= bounds.grad_norm_rel)}"
        )
        if ref_id != reference_id(row):
            msg += f"; against {ref_id}: {probe_cause(row)}"
        out.append(
            judge(
                "clip_acts",
                row,
                rel <= bounds.grad_norm_rel,
                rel,
                bounds.grad_norm_rel,
                msg,
                step=step,
                param="gradient norm",
            )
        )
    return out


# how far a gradient an engine clipped may read from max_norm: its own rounding, and the 1e-6 clip_grad_norm_ adds
# to the norm it divides by (at a pre-clip norm above max_norm, below 1e-6 / max_norm relative)
ENGINE_CLIPPED_REL = 1e-4


def _clipped_by_engine(row, mine, norm_type: float, max_norm: float) -> Verdict:
    """An implementation that clips inside its own step: the gradient it applied (harness.measure.applied) has the
    norm max_norm at every step where clipping acted; the plain model's pre-clip norm, above max_norm at every
    step, is held on its own row."""
    kind = "L2" if norm_type == 2 else "infinity"
    if mine is None or mine.clip_norm.isna().any():
        return not_measured("clip_acts", row, "no norm of the applied gradient recorded at every step")
    rel = (mine.clip_norm - max_norm).abs() / max_norm
    idle = mine[rel > ENGINE_CLIPPED_REL]
    if len(idle):
        first = idle.iloc[0]
        return judge(
            "clip_acts",
            row,
            False,
            float(first.clip_norm),
            max_norm,
            f"the implementation clips inside its own step, and the gradient it applied at step {int(first.step)} has "
            f"the {kind} norm {first.clip_norm:.6g}, not max_norm {max_norm:g}: clipping did not act, or not to "
            "max_norm",
            step=int(first.step),
            param="gradient norm",
            where="clipping did not act",
        )
    return judge(
        "clip_acts",
        row,
        True,
        float(rel.max()),
        ENGINE_CLIPPED_REL,
        f"the implementation clips inside its own step: the gradient it applied has the {kind} norm max_norm "
        f"{max_norm:g} at every step (within {float(rel.max()):.2g} relative)",
    )


def _clip_row(row) -> bool:
    return row.status == "ok" and clip_of(Scenario.of_row(row).feature) is not None


NORM_CHECKS = (
    Check(grad_norm_matches, not_reference, {"scenarios": ROW, "steps": ("scenario", "step", "loss", "grad_norm")}),
    Check(clip_acts, _clip_row, {"scenarios": ROW, "steps": ("scenario", "step", "clip_norm")}),
)
