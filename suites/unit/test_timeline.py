"""The unit timeline (harness/measure/timeline.py): which units hold their full parameters."""

from __future__ import annotations

import torch
from torch import nn

from harness.measure.timeline import ROOT, UnitTimeline


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
    assert tl.records()[0] | {"moments": 0} == {"phase": "forward", "moments": 0, "units": 1, "which": "0",
                                                "root": True}
    model[1].weight = nn.Parameter(torch.zeros(4, 4))
    model[1].bias = nn.Parameter(torch.zeros(4))
    tl.sample()
    model[0].weight = nn.Parameter(torch.zeros(8))
    tl.mark("after_forward")
    rec = {r["phase"]: r for r in tl.records()}
    assert rec["forward"]["units"] == 2 and rec["forward"]["which"] == "0, 1" and rec["forward"]["moments"] == 2
    assert rec["after_forward"]["units"] == 1 and rec["after_forward"]["which"] == "1"


def test_nested_units_claim_their_own_parameters_and_tied_ones_count_once():
    inner = nn.Linear(2, 2)
    outer = nn.Sequential(inner, nn.Linear(2, 2))
    head = nn.Linear(2, 2, bias=False)
    model = nn.Sequential(outer, head)
    head.weight = inner.weight  # tied across units: the first unit (inner) has it
    tl = UnitTimeline(model, [inner, outer])
    sizes = {u.name: u.elements for u in tl.units}
    assert sizes == {"0.0": 6, "0": 6}  # the root's only parameter is tied to inner: it has none of its own
