"""Census: what a rank holds, found from the process (harness/measure/census.py)."""

from __future__ import annotations

import torch
from torch import nn

import harness.measure.census as census_module
from harness.measure.census import Census


def _held(census, model, opt=None, exclude=()):
    return census.held(model, opt, exclude=exclude)


NOTHING_ELSE = {"buffers": 0, "other": 0, "unattributed": 0}


def test_census_counts_tied_storage_once():
    with Census() as census:
        emb = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = nn.Sequential(emb, head)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.arange(3)
        model(x).sum().backward()
        opt.step()
        assert _held(census, model, opt, [x]) == {"params": 160, "grads": 160, "optimizer_state": 160, **NOTHING_ELSE}


def test_census_counts_views_of_one_flat_buffer_once():
    """Parameters that are views into one flat storage (FSDP1, fsdp_impl) count that storage."""
    with Census() as census:
        flat = torch.zeros(24)  # 96 bytes: 2 x 10 elements used, 4 of padding
        model = nn.Module()
        model.a = nn.Parameter(flat[:10])
        model.b = nn.Parameter(flat[10:20])
        del flat
        assert _held(census, model) == {"params": 96, "grads": 0, "optimizer_state": 0, **NOTHING_ELSE}


def test_census_leaves_out_what_the_process_held_before_and_what_the_harness_names():
    earlier = torch.zeros(1000)  # alive before the census: the process's, not the scenario's
    with Census() as census:
        model = nn.Linear(4, 4, bias=False)  # 64 B
        batch = torch.zeros(100)
        assert _held(census, model, exclude=[batch]) == {"params": 64, "grads": 0, "optimizer_state": 0, **NOTHING_ELSE}
        assert _held(census, model)["other"] == 400
        del earlier


def test_census_finds_a_buffer_kept_where_model_and_optimizer_do_not_show_it():
    """A full-size copy kept in a closure and an optimizer wrapper's own state: both "other"."""
    with Census() as census:
        model = nn.Linear(8, 8, bias=False)  # 256 B
        kept = model.weight.detach().clone()
        hook = model.register_forward_pre_hook(lambda m, args, kept=kept: kept.sum())  # the hook holds it

        class Wrapper(torch.optim.SGD):  # state outside optimizer.state
            def __init__(self, params):
                super().__init__(params, lr=0.1)
                self.shadow = [p.detach().clone() for p in self.param_groups[0]["params"]]

        opt = Wrapper(model.parameters())
        del kept
        held = _held(census, model, opt)
        assert held["params"] == 256 and held["optimizer_state"] == 0
        assert held["other"] == 2 * 256
        hook.remove()


def test_census_does_not_count_what_another_thread_releases_a_moment_later(monkeypatch):
    """gloo's worker thread drops a collective's buffers just after the collective returned: here
    the buffer goes during the pause between the census's two looks."""
    with Census() as census:
        model = nn.Linear(4, 4, bias=False)
        in_flight = [torch.zeros(300)]  # 1,200 B: more than the 1,024 tolerated
        kept = [torch.zeros(10)]
        pauses = []
        monkeypatch.setattr(census_module.time, "sleep", lambda s: (pauses.append(s), in_flight.clear()))
        held = census.held(model, None, tolerated=1024)
        assert pauses == list(census_module.SETTLE_S[:1])  # 40 B left, 1,024 tolerated: no further look
        assert held["other"] == 40  # the kept tensor only
        del kept


def test_census_does_not_pause_for_what_no_verdict_would_read_as_too_much(monkeypatch):
    """A correct run's few bytes of bookkeeping under "other" (within `tolerated`) cost no pause: a look after one
    could only lower a figure that already passes."""
    with Census() as census:
        model = nn.Linear(4, 4, bias=False)
        kept = [torch.zeros(200)]  # 800 B
        pauses = []
        monkeypatch.setattr(census_module.time, "sleep", pauses.append)
        held = census.held(model, None, tolerated=1024)
        assert pauses == []
        assert held["other"] == 800
        del kept


def test_census_waits_for_a_thread_that_runs_late_while_more_than_tolerated_reads_as_other(monkeypatch):
    """On a loaded machine the thread may drop its buffers only after several pauses (a torchrun job
    beside other work still held 2,152 B at the second look): the census looks again while more than
    `tolerated` bytes read as "other", and stops once they are gone."""
    with Census() as census:
        model = nn.Linear(4, 4, bias=False)
        in_flight, kept = [torch.zeros(500)], [torch.zeros(10)]
        pauses = []

        def sleep(s):
            pauses.append(s)
            if len(pauses) == 3:
                in_flight.clear()

        monkeypatch.setattr(census_module.time, "sleep", sleep)
        held = census.held(model, None, tolerated=1024)
        assert pauses == list(census_module.SETTLE_S[:3])
        assert held["other"] == 40
        del kept


def test_what_stays_held_above_tolerated_is_looked_at_after_every_pause_and_counted(monkeypatch):
    with Census() as census:
        model = nn.Linear(4, 4, bias=False)
        kept = [torch.zeros(500)]
        pauses = []
        monkeypatch.setattr(census_module.time, "sleep", pauses.append)
        held = census.held(model, None, tolerated=1024)
        assert pauses == list(census_module.SETTLE_S)
        assert held["other"] == 2000
        del kept


def test_census_files_buffers_apart_and_a_freed_storage_as_zero():
    with Census() as census:
        model = nn.BatchNorm1d(4)  # weight, bias: params; running mean, var, count: buffers
        gone = torch.zeros(50)
        gone.untyped_storage().resize_(0)
        held = _held(census, model)
        assert held["params"] == 2 * 16 and held["buffers"] == 2 * 16 + 8 and held["other"] == 0
        del gone


def test_a_closed_census_leaves_nothing_frozen():
    import gc

    before = gc.get_freeze_count()
    with Census():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == before


def test_censuses_that_keep_the_process_frozen_see_only_each_scenarios_own_storages():
    """keep_frozen: one census after another, as a rank runs scenarios. The second walks only what
    was made since the first froze, yet what the process held before either (a view of it made in
    the scenario included) is not the scenario's, and each scenario's storages are its own."""
    import gc

    start = gc.get_freeze_count()
    old = torch.zeros(64)  # the process's own, alive before both censuses
    try:
        with Census(keep_frozen=True) as first:
            a = nn.Linear(4, 4, bias=False)  # 64 B
            assert _held(first, a)["params"] == 64 and _held(first, a)["other"] == 0
        kept = gc.get_freeze_count()
        assert kept > start  # left frozen
        between = torch.zeros(32)  # made between the scenarios: alive when the second begins
        with Census(keep_frozen=True) as second:
            assert gc.get_freeze_count() - kept < kept - start  # only what was made since was walked
            b = nn.Linear(2, 2, bias=False)  # 16 B
            view_of_old, view_between = old[:8], between[:4]
            assert _held(second, b) == {"params": 16, "grads": 0, "optimizer_state": 0, **NOTHING_ELSE}
            del view_of_old, view_between
        try:
            with Census(keep_frozen=True):
                raise ValueError("a failed scenario")
        except ValueError:
            pass
        assert gc.get_freeze_count() == 0  # a failure unfreezes: its objects must be collectable
    finally:
        census_module._KEPT.clear()
        gc.unfreeze()


def _adamw_stepped(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 8)).sum().backward()
    opt.step()
    return opt


def test_census_finds_the_state_of_an_optimizer_inside_a_wrapper():
    """A wrapper whose own `state` is empty (the optimizer inside it holds exp_avg and exp_avg_sq):
    the census finds every optimizer the scenario made, so the inner state is optimizer state."""
    from suites.mutants.hidden_mutants import DelegatingOptimizer

    with Census() as census:
        model = nn.Linear(8, 8, bias=False)  # 256 B
        wrapper = DelegatingOptimizer(_adamw_stepped(model))
        assert _held(census, model, wrapper)["other"] == 2 * 256 + 4  # the wrapper alone: hidden state
        held = _held(census, model, census.optimizers(wrapper))
        assert held["optimizer_state"] == 2 * 256 + 4 and held["other"] == 0  # + the step count (fp32)


def test_peak_tracker_takes_an_object_that_only_looks_like_an_optimizer():
    """A duck-typed wrapper (not a torch Optimizer) is measured, not a crash (the torch tracker
    refuses any object that is not a module, optimizer or tensor); the optimizer inside is tracked."""
    from harness.measure import PeakMemory

    class Duck:
        def __init__(self, inner):
            self.inner, self.param_groups = inner, inner.param_groups

        def step(self):
            self.inner.step()

    with Census() as census:
        model = nn.Linear(8, 8, bias=False)
        duck = Duck(_adamw_stepped(model))
        optimizers = census.optimizers(duck)
        assert optimizers[0] is duck and duck.inner in optimizers
        with PeakMemory(model, optimizers, "cpu") as mem:
            model(torch.ones(1, 8)).sum().backward()
            duck.step()
        assert mem.result()["optimizer_state"] >= 2 * 256
