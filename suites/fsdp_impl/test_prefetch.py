"""fsdp_impl prefetching: each unit's all-gather is issued, asynchronously, before the unit ahead
of it computes (forward) or before the unit after it computes its backward; at most two units
are gathered at once besides the root; nothing stays gathered after a step, even when a forward
leaves the recorded path. (Numerics: every training test of test_fsdp_impl.py runs two or more
steps, so from the second step on with prefetching, against the plain model.)"""

from __future__ import annotations

import pytest

TASKS = "suites.fsdp_impl.worlds.prefetching"
ORDER = ["<root>", "embed", "blocks.0", "blocks.1"]  # tinylm's units in forward order


def _index(events: list, kind: str, unit: str, **match) -> int:
    for i, e in enumerate(events):
        if e[0] == kind and e[1] == unit and all(e[2] == v for v in match.values()):
            return i
    raise AssertionError(f"no {kind} event for {unit} {match or ''} in {events}")


@pytest.mark.parametrize("n", [2, 4])
def test_the_next_unit_is_gathered_while_this_one_computes(world, n):
    for got in world(n).call(f"{TASKS}:events", {"model": "tinylm", "batch": 8, "steps": 3}):
        for step, events in enumerate(got["steps"], 1):
            forward = events[: _index(events, "backward", "<root>")]
            backward = events[len(forward) :]
            if step == 1:  # the first forward records the order: no prefetching before its end
                assert not [e for e in forward if e[0] == "gather" and e[2]], forward
            for a, b in zip(ORDER, ORDER[1:]) if step > 1 else ():  # b's gather issued before a computes
                assert _index(forward, "gather", b, async_op=True) < _index(forward, "compute", a)
                assert ("gather", b, False) not in forward  # and never gathered again, blocking
            for a, b in zip(ORDER[1:], ORDER[2:]):  # backward: a's gather issued before b's backward
                assert _index(backward, "gather", a, async_op=True) < _index(backward, "backward", b)
                assert ("gather", a, False) not in backward
            for e in events:
                if e[0] in ("compute", "backward"):
                    assert len(e[2]) <= 2, f"{e[1]} {e[0]} with {e[2]} gathered"
        assert got["after"] == [[]] * 3  # nothing left gathered after any step


def test_a_prefetch_the_forward_did_not_use_is_freed(world):
    got = world(2).call(f"{TASKS}:changed_path", {})[0]
    assert got == {"after_forward_3": [], "after_backward_3": [], "after_forward_2": [], "after_backward_2": []}
