"""The unit timeline (harness/measure/timeline.py): which units hold their full parameters."""

from __future__ import annotations

import torch
from torch import nn

from harness.checks import resources
from harness.measure.timeline import ROOT, UnitTimeline
from suites.harness.unit.synthetic_tables import LOSSES, ZERO, frame
from suites.harness.unit.synthetic_tables import cell as _sc
from suites.harness.unit.synthetic_tables import check_tables as make


def _model():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    return model, [model[0], model[1]]  # the last layer is the root's own


def test_units_count_as_gathered_by_the_storage_behind_their_module_attributes():
    model, units = _model()
    tl = UnitTimeline(model, units)
    assert tl.gathered() == ["0", "1", ROOT]  # the plain model: everything full
    # shard unit 0 the way a flat-parameter ZeRO-3 does: its attributes become views into a freed buffer
    flat = torch.zeros(20)
    for name, n in (("weight", 16), ("bias", 4)):
        delattr(model[0], name)
        setattr(model[0], name, flat[:n])
    flat.untyped_storage().resize_(0)
    assert tl.gathered() == ["1", ROOT]
    flat.untyped_storage().resize_(20 * 4)  # all-gathered again
    assert tl.gathered() == ["0", "1", ROOT]


def test_a_half_shard_is_not_gathered_and_phases_keep_their_worst_moment():
    model, units = _model()
    tl = UnitTimeline(model, units)
    model[1].weight = nn.Parameter(torch.zeros(8))  # half the elements (a shard at W = 2)
    model[1].bias = nn.Parameter(torch.zeros(2))
    tl.mark("forward")
    assert tl.records()[0] | {"moments": 0} == {
        "phase": "forward",
        "moments": 0,
        "units": 1,
        "which": "0",
        "root": True,
        "params": True,
    }
    model[1].weight = nn.Parameter(torch.zeros(4, 4))
    model[1].bias = nn.Parameter(torch.zeros(4))
    tl.sample()
    model[0].weight = nn.Parameter(torch.zeros(8))
    tl.mark("after_forward")
    rec = {r["phase"]: r for r in tl.records()}
    assert rec["forward"]["units"] == 2 and rec["forward"]["which"] == "0, 1" and rec["forward"]["moments"] == 2
    assert rec["after_forward"]["units"] == 1 and rec["after_forward"]["which"] == "1"


def test_a_unit_gathered_one_leaf_module_at_a_time_is_seen_as_parameters_not_as_a_unit():
    # DeepSpeed ZeRO-3 before its trace is complete (an engine's first forward, a resumed run's measured step):
    # each leaf module's parameters gathered for its own forward and released after it, no prefetch
    block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model = nn.Sequential(block, nn.Linear(4, 2))
    tl = UnitTimeline(model, [block])
    for m in model.modules():
        for name in list(m._parameters):
            m._parameters[name] = nn.Parameter(torch.empty(0))  # partitioned: nothing of it here
    block[0].weight = nn.Parameter(torch.zeros(4, 4))  # one leaf's weight gathered
    tl.mark("forward")
    [rec] = tl.records()
    assert rec["units"] == 0 and not rec["root"] and rec["params"]


def test_nested_units_claim_their_own_parameters_and_tied_ones_count_once():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner, nn.Linear(2, 2))
    head = nn.Linear(2, 2, bias=False)
    model = nn.Sequential(outer, head)
    head.weight = inner.weight  # tied across units: the first unit (inner) has it
    tl = UnitTimeline(model, [inner, outer])
    sizes = {u.name: u.elements for u in tl.units}
    assert sizes == {"0.0": 6, "0": 6}  # the root's only parameter is tied to inner: it has none of its own


def _timeline(sc, **units):
    """A gathered table: every phase on two ranks, one unit at most unless `units` says otherwise."""
    from harness.measure.timeline import PHASES

    rows = [
        dict(
            scenario=sc.id,
            rank=r,
            phase=p,
            moments=5,
            units=units.get(p, 1 if p in ("forward", "backward") else 0),
            which="x",
            root=False,
        )
        for r in (0, 1)
        for p in PHASES
    ]
    return frame("gathered", rows)


def test_units_gathered_fails_a_unit_left_gathered_after_forward_and_names_the_phase():
    sc = _sc("fsdp_impl", 4)
    t = make([(sc, LOSSES, ZERO, ZERO)])
    t["gathered"] = _timeline(sc)
    [v] = resources.units_gathered(t)
    assert v.status == "pass", v
    t["gathered"] = _timeline(sc, after_forward=2)  # two units kept after forward: one more than prefetch allows
    [v] = resources.units_gathered(t)
    assert v.status == "fail" and v.rank == 0 and v.where.startswith("after forward on rank 0: 2 units gathered")
    t["gathered"] = _timeline(sc, forward=3)  # three at once in forward
    [v] = resources.units_gathered(t)
    assert v.status == "fail" and v.where.startswith("forward")


def test_units_gathered_fails_the_root_kept_after_backward_and_a_timeline_that_saw_nothing():
    sc = _sc("fsdp_impl", 4)
    t = make([(sc, LOSSES, ZERO, ZERO)])
    t["gathered"] = _timeline(sc)
    t["gathered"].loc[t["gathered"].phase == "after_backward", "root"] = True
    [v] = resources.units_gathered(t)
    assert v.status == "fail" and "root's own parameters still gathered" in v.where
    t["gathered"] = _timeline(sc, forward=0, backward=0)  # full parameters never seen: nothing was measured
    [v] = resources.units_gathered(t)
    assert v.status == "fail" and "could not be checked" in v.message
    t["gathered"]["params"] = t["gathered"].phase == "forward"  # parameters seen full, never a whole unit: measured
    [v] = resources.units_gathered(t)
    assert v.status == "pass", v
    t["gathered"] = _timeline(sc).query("phase != 'optimizer'")
    [v] = resources.units_gathered(t)
    assert v.status == "fail" and "optimizer" in v.message
