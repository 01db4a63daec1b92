"""A split run's trajectory that left the full batch's, replayed step by step before it is blamed.

Split data is held to full-batch training over the whole trajectory, with each parameter's noise floor
(harness/core/policy.py [Note: noise floor]). The floor is one draw: where a ReLU's input lies within rounding
of zero, two correct orders of summation send a token to either side of the kink, and AdamW turns the changed
gradient into a step of its own size, so a correct run lands on a trajectory no probe took ([Note: trajectory
replayed]). Before such a crossing FAILs, the run is replayed up to the step of the crossing with its
yardstick, every op traced (harness.localize.replay): the yardstick starts each step from the run's
parameters and its optimizer steps on the run's gradients. If every step then computed what the plain model
computes there (forward and backward bit for bit, the reduction within its summation rounding, the
optimizer's update bit for bit), the run did nothing the plain model would not have done from where it
stood: its parameters are held to AdamW's reach, the most two runs can part by whatever their gradients
(policy.adamw_reach), and the verdict says so. Otherwise the localised point is the verdict's cause.
"""

from __future__ import annotations

import dataclasses

from harness.core.policy import Bounds
from harness.core.scenario import OPTIMIZERS, REFERENCE_IMPL, Scenario
from harness.core.verdict import FAIL, PASS, Verdict
from harness.localize.replay import replay_or_why

CHECK = "split_matches_full_batch"
REPLAYED = "replayed step by step"  # in every verdict a replay judged (harness.localize.auto does not redo it)


def candidates(scenarios: list[Scenario], verdicts: list[Verdict], bounds: Bounds) -> list[tuple[int, Scenario]]:
    """(index in `verdicts`, scenario) of each split crossing a replay can clear: FAIL of CHECK at a step, the
    run's only failing verdict, a built-in optimizer with a reach (AdamW: SGD moves by its gradient, so no
    bound beyond the tier's can be derived), a run trained from scratch (a resumed run's optimizer state is
    its saver's), and every parameter within that reach."""
    by_id = {s.id: s for s in scenarios}
    failing: dict[str, int] = {}
    for v in verdicts:
        if v.status == FAIL:
            failing[v.scenario] = failing.get(v.scenario, 0) + 1
    out = []
    for i, v in enumerate(verdicts):
        sc = by_id.get(v.scenario)
        if (
            v.check != CHECK
            or v.status != FAIL
            or sc is None
            or sc.impl == REFERENCE_IMPL
            or v.step is None
            or failing.get(v.scenario) != 1
            or sc.optimizer not in OPTIMIZERS
            or sc.resume_from
            or v.measured is None
            or not v.measured == v.measured
        ):
            continue
        reach = bounds.reach(sc.optimizer, sc.lr, sc.steps)
        if reach > 0 and v.measured <= reach:
            out.append((i, sc))
    return out


def replay_crossings(
    scenarios: list[Scenario], verdicts: list[Verdict], pool, bounds: Bounds = Bounds(), say=lambda line: None
) -> list[Verdict]:
    """`verdicts` with each candidate crossing replayed (`pool`: a WorldPool): PASS held to the reach where
    every step matched its yardstick beyond rounding, else FAIL naming where the run parted."""
    chosen = candidates(scenarios, verdicts, bounds)
    if not chosen:
        return verdicts
    say(f"replaying {len(chosen)} split run(s) whose trajectory left the full batch's, step by step")
    out = list(verdicts)
    for i, sc in chosen:
        v = out[i]
        found, why = replay_or_why(sc, pool=pool, steps=v.step)
        if found is None:  # the verdict stands as judged; the replay says why it could not run
            out[i] = dataclasses.replace(
                v, message=f"{v.message.rstrip('. ')}. The crossing could not be {REPLAYED} ({why}), so it stands"
            )
            continue
        out[i] = judged(v, sc, found, bounds)
        say(f"  {sc.id}: {out[i].status}")
    return out


def judged(v: Verdict, sc: Scenario, found, bounds: Bounds) -> Verdict:
    """The crossing `v` after its replay `found` (harness.localize.replay.Localised)."""
    steps = f"steps {found.steps[0]}-{found.steps[-1]}"
    if found.diverged:
        return dataclasses.replace(
            v,
            message=f"{v.message.rstrip('. ')}. The run, {REPLAYED} ({steps}), "
            f"parted from the plain model's computation: {found.short()}",
        )
    reach = bounds.reach(sc.optimizer, sc.lr, sc.steps)
    how = (
        "every op bit for bit"
        if found.point is None
        else "forward and backward bit for bit, the gradient reduction within the rounding of summing its terms in "
        "another order, the optimizer's update bit for bit"
    )
    return dataclasses.replace(
        v,
        status=PASS,
        bound=reach,
        message=(
            f"{v.message.rstrip('. ')}. Not the implementation: {REPLAYED} ({steps}) from the run's own "
            f"parameters and gradients, every step computed what the plain model computes there ({how}), so the "
            f"trajectory left the full batch's by the model's own amplification of rounding (model-sensitive, found "
            f"by replay: a token near a kink such as a ReLU's zero, sent the other way, then AdamW's step of its own "
            f"size). Held instead to AdamW's reach {reach:.3g}, the most two runs can part by whatever their "
            f"gradients (harness/core/policy.py [Note: trajectory replayed])"
        ),
    )
