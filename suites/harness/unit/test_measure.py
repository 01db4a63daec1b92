"""harness.measure: collective counting, state bytes, peak memory, the one-process planner.

One 2-rank gloo world (the harness's World, started once for the module) runs every multi-rank
measurement and returns plain dicts; the assertions here compare them with values computed
independently from tensor shapes (never with another output of the code under test).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure import CommCounter, PeakMemory, ideal_comm_elements, ideal_state_bytes
from harness.measure.census import Census

W = 2
# Raw collectives: (elements, dtype) per call; the expected bytes are derived below.
AG_N, AG_DT = 5, torch.float64  # all_gather_into_tensor: shard of 5 -> output 10 x 8 bytes
RS_N, RS_DT = 7, torch.float32  # reduce_scatter_tensor: output 7 -> input 14 x 4 bytes
AR_N, AR_DT = 9, torch.int64  # all_reduce, called twice
FAG_N, FRS_N, FAR_N = 3, 8, 4  # functional all_gather / reduce_scatter / all_reduce, float32
BK_N = 6  # all_reduce on the gloo backend object directly (bypasses the dispatcher)
# MLPs: layer widths. EVEN has dim 0 divisible by W everywhere (no FSDP2 padding); ODD does not.
EVEN, ODD = (16, 32, 8), (5, 7, 3)


def mlp(widths: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def linear_shapes(widths: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Parameter shapes of `mlp(widths)`, from the widths alone."""
    return [s for a, b in zip(widths, widths[1:]) for s in ((b, a), (b,))]


def full_bytes(widths: tuple[int, ...], itemsize: int = 4) -> int:
    return sum(math.prod(s) for s in linear_shapes(widths)) * itemsize


def dim0_padded_bytes(widths: tuple[int, ...], world: int, itemsize: int = 4) -> int:
    """FSDP2's rule: each parameter is padded along dim 0 to a multiple of W before sharding."""
    return sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) for s in linear_shapes(widths)) * itemsize


# ------------------------------------------------------------------ inside each rank


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).sum().backward()
    opt.step()


def _fsdp2(widths, group) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model, mesh = mlp(widths), DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _measured(build, widths) -> dict[str, Any]:
    """Build under a Census; one warm-up step, then one step under CommCounter + PeakMemory; grads kept."""
    census = Census()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(1))
    _step(model, opt, x)
    opt.zero_grad()
    with PeakMemory(model, opt, "cpu", extra=[x]) as pm, CommCounter() as cc:
        _step(model, opt, x)
    held = census.held(model, opt, exclude=[x])
    census.close()
    return {"comm": cc.summary(), "state": held, "peak": pm.result()}


def _raw_collectives() -> list[dict]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    g = dist.group.WORLD
    with CommCounter() as cc:
        dist.all_gather_into_tensor(torch.empty(W * AG_N, dtype=AG_DT), torch.ones(AG_N, dtype=AG_DT))
        dist.reduce_scatter_tensor(torch.empty(RS_N, dtype=RS_DT), torch.ones(W * RS_N, dtype=RS_DT))
        for _ in range(2):
            dist.all_reduce(torch.ones(AR_N, dtype=AR_DT))
        funcol.wait_tensor(funcol.all_gather_tensor(torch.ones(FAG_N), 0, g))
        funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.ones(W * FRS_N), "sum", 0, g))
        funcol.wait_tensor(funcol.all_reduce(torch.ones(FAR_N), "sum", g))
        g._get_backend(torch.device("cpu")).allreduce([torch.ones(BK_N)]).wait()
    return cc.summary()


def _thread_collectives() -> list[dict]:
    """Collectives from a thread of the rank's own while the counter is active in the main thread,
    then one from the main thread: each must be counted, once."""
    import threading

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    def other_thread() -> None:
        dist.all_gather_into_tensor(torch.empty(W * AG_N, dtype=AG_DT), torch.ones(AG_N, dtype=AG_DT))
        dist.reduce(torch.ones(RS_N), dst=0)
        dist.gather(torch.ones(FAG_N), [torch.empty(FAG_N) for _ in range(W)] if dist.get_rank() == 0 else None)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(FAR_N), "sum", dist.group.WORLD))  # a functional one
        with torch.inference_mode():  # (inference mode leaves autograd's dispatch keys out)
            dist.broadcast(torch.ones(BK_N), src=0)

    with CommCounter() as cc:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        dist.all_reduce(torch.ones(AR_N, dtype=AR_DT))
    return cc.summary()


def _solo(group) -> list[dict]:
    """Collectives over a group of one rank (c10d and functional): recorded with ranks 1."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    with CommCounter() as cc:
        dist.all_gather_into_tensor(torch.empty(AG_N), torch.ones(AG_N), group=group)
        funcol.wait_tensor(funcol.all_reduce(torch.ones(FAR_N), "sum", group))
    return cc.summary()


GATHERED = 1 << 16  # elements of the weight each rank gathers in `_gathered` (256 KiB a copy)


def _gathered(what: str) -> dict[str, int]:
    """A step of a plain Linear in which every rank all-gathers W copies of `what` (its gradient
    scaled, as a reduction spelled reduce-scatter + all-gather gathers a reduced gradient; or a copy
    of its weight, as ZeRO-3 gathers a parameter) and keeps them to the end: the peak's breakdown."""
    import torch.distributed as dist

    model = nn.Linear(GATHERED, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PeakMemory(model, opt, "cpu") as pm:
        model(torch.ones(1, GATHERED)).sum().backward()
        source = model.weight.grad * 0.5 if what == "grads" else model.weight.detach() * 1.0
        out = torch.empty(W * GATHERED)
        dist.all_gather_into_tensor(out, source.flatten())
        out.sum()  # a new peak, taken with the gathered copies filed (they are filed once gathered)
        opt.step()
        del out
    return pm.result()


def measured_world(ctx, payload) -> dict[str, Any]:
    """Every multi-rank measurement, in one rank of the module's world of W (a World task)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    solo, _ = dist.new_subgroups(group_size=1)  # this rank alone: the W=1 runs
    out: dict[str, Any] = {"raw": _raw_collectives(), "threads": _thread_collectives(), "solo": _solo(solo)}
    for widths, tag in ((EVEN, "even"), (ODD, "odd")):
        out[f"fsdp2_w2_{tag}"] = _measured(lambda: _fsdp2(widths, dist.group.WORLD), widths)
    out["fsdp2_w1"] = _measured(lambda: _fsdp2(EVEN, solo), EVEN)
    out["ddp_w2"] = _measured(lambda: DDP(mlp(EVEN), gradient_as_bucket_view=True), EVEN)
    out["plain"] = _measured(lambda: mlp(EVEN), EVEN)
    out["gathered"] = {what: _gathered(what) for what in ("grads", "params")}
    return out


@pytest.fixture(scope="module")
def world() -> dict[int, dict[str, Any]]:
    """rank -> what `measured_world` measured there, in a world of W started for this module (a failing rank
    fails the tests that need it, with its traceback)."""
    from harness.execute.world import World

    with World(W, timeout_s=240) as live:
        return dict(enumerate(live.call(f"{__name__}:measured_world")))


def _by_name(summary: list[dict]) -> dict[str, tuple[int, int]]:
    """collective -> (calls, bytes), summed over element types."""
    out: dict[str, tuple[int, int]] = {}
    for row in summary:
        calls, nbytes = out.get(row["collective"], (0, 0))
        out[row["collective"]] = (calls + row["calls"], nbytes + row["bytes"])
    return out


# ------------------------------------------------------------------ CommCounter


def test_raw_collectives_counted_with_full_tensor_bytes(world):
    expected = {
        "all_gather": (2, W * AG_N * 8 + W * FAG_N * 4),  # output = W x input
        "reduce_scatter": (2, W * RS_N * 4 + W * FRS_N * 4),  # input = W x output
        "all_reduce": (4, 2 * AR_N * 8 + FAR_N * 4 + BK_N * 4),  # the tensor; incl. backend call
    }
    for rank in range(W):
        assert _by_name(world[rank]["raw"]) == expected, rank


def test_raw_collectives_counted_per_element_type_in_elements_and_bytes(world):
    rows = {(r["collective"], r["dtype"]): (r["calls"], r["elements"], r["bytes"]) for r in world[0]["raw"]}
    assert rows == {
        ("all_gather", "float64"): (1, W * AG_N, W * AG_N * 8),
        ("all_gather", "float32"): (1, W * FAG_N, W * FAG_N * 4),
        ("reduce_scatter", "float32"): (2, W * RS_N + W * FRS_N, (W * RS_N + W * FRS_N) * 4),
        ("all_reduce", "int64"): (2, 2 * AR_N, 2 * AR_N * 8),
        ("all_reduce", "float32"): (2, FAR_N + BK_N, (FAR_N + BK_N) * 4),
    }


def test_each_collective_is_recorded_with_the_size_of_its_group(world):
    """c10d ops, functional collectives and backend calls over the world, from any thread, read its W ranks;
    the same over a group of one rank read 1 (feature reshard2's regather is told apart by it)."""
    for rank in range(W):
        assert {r["ranks"] for r in world[rank]["raw"] + world[rank]["threads"]} == {W}, rank
        assert {(r["collective"], r["ranks"]) for r in world[rank]["solo"]} == {("all_gather", 1), ("all_reduce", 1)}


def test_collectives_from_another_thread_are_counted_once(world):
    """c10d calls, a functional collective and a call under inference mode from a thread of the rank's own."""
    for rank in range(W):
        rows = {(r["collective"], r["dtype"]): (r["calls"], r["elements"]) for r in world[rank]["threads"]}
        assert rows == {
            ("all_gather", "float64"): (1, W * AG_N),
            ("reduce", "float32"): (1, RS_N),
            ("gather", "float32"): (1, W * FAG_N),
            ("all_reduce", "int64"): (1, AR_N),
            ("all_reduce", "float32"): (1, FAR_N),
            ("broadcast", "float32"): (1, BK_N),
        }, rank


@pytest.mark.parametrize("tag,widths", [("even", EVEN), ("odd", ODD)])
def test_fsdp2_step_moves_2x_params_gathered_and_1x_reduce_scattered(world, tag, widths):
    comm = _by_name(world[0][f"fsdp2_w2_{tag}"]["comm"])
    padded = dim0_padded_bytes(widths, W)
    n_layers = len(widths) - 1
    # Rule: bytes are of the dim-0-padded parameters; equal to the full size when nothing pads.
    assert comm["all_gather"] == (2 * n_layers, 2 * padded)  # forward + backward re-gather
    assert comm["reduce_scatter"] == (n_layers, padded)
    assert set(comm) == {"all_gather", "reduce_scatter"}
    if tag == "even":
        assert padded == full_bytes(widths)
        elements = {r["collective"]: r["elements"] for r in world[0][f"fsdp2_w2_{tag}"]["comm"]}
        assert elements == ideal_comm_elements(full_bytes(widths, itemsize=1), W)
    else:
        assert padded > full_bytes(widths)


def test_ddp_step_all_reduces_the_gradients_once(world):
    calls, nbytes = _by_name(world[0]["ddp_w2"]["comm"])["all_reduce"]
    assert nbytes == full_bytes(EVEN)


def test_ideal_comm_elements():
    assert ideal_comm_elements(1000, 1) == {}
    assert ideal_comm_elements(1000, 8) == {"all_gather": 2000, "reduce_scatter": 1000}
    assert ideal_comm_elements(1000, 8, trainable_elements=600) == {"all_gather": 2000, "reduce_scatter": 600}


# ------------------------------------------------------------------ Census (state held)


def test_census_fsdp2_halves_and_matches_shard_sizes(world):
    full = full_bytes(EVEN)
    w1, w2 = world[0]["fsdp2_w1"]["state"], world[0]["fsdp2_w2_even"]["state"]
    n_tensors = len(linear_shapes(EVEN))
    assert w1["params"] == w1["grads"] == full
    for rank in range(W):
        s = world[rank]["fsdp2_w2_even"]["state"]
        assert s["params"] == s["grads"] == full // W
        # AdamW: exp_avg + exp_avg_sq per shard, plus one scalar step counter (<= 8 bytes) each
        assert 2 * full // W <= s["optimizer_state"] <= 2 * full // W + 8 * n_tensors
    total = lambda s: sum(s.values())  # noqa: E731
    assert total(w2) / total(w1) == pytest.approx(0.5, rel=0.02)


def test_census_ddp_equals_unsharded(world):
    ddp, plain = world[0]["ddp_w2"]["state"], world[0]["plain"]["state"]
    assert ddp == plain
    assert ddp["params"] == ddp["grads"] == full_bytes(EVEN)


def test_ideal_state_bytes():
    assert ideal_state_bytes(800, "adamw", 4) == {"params": 200, "grads": 200, "optimizer_state": 400}
    assert ideal_state_bytes(800, "sgd", 4, sharded=False) == {"params": 800, "grads": 800, "optimizer_state": 800}
    with pytest.raises(ValueError):
        ideal_state_bytes(800, "lion", 2)


# ------------------------------------------------------------------ PeakMemory


@pytest.mark.parametrize("case", ["plain", "ddp_w2", "fsdp2_w2_even", "fsdp2_w1"])
def test_peak_is_positive_covers_state_and_sums_categories(world, case):
    for rank in range(W):
        peak, state = world[rank][case]["peak"], world[rank][case]["state"]
        assert peak["peak"] > 0
        assert peak["peak"] >= sum(state.values())
        assert peak["peak"] == sum(v for k, v in peak.items() if k != "peak")


def test_fsdp2_w2_peak_below_unsharded_peak(world):
    assert world[0]["fsdp2_w2_even"]["peak"]["peak"] < world[0]["plain"]["peak"]["peak"]


def test_an_all_gather_of_gradient_data_is_filed_under_grads_not_params(world):
    """An all-reduce spelled as reduce-scatter + all-gather (fsdp_impl's HSDP replica exchange) gathers
    a reduced gradient: counted as parameters it made peak_params_bound fail a correct implementation.
    A gathered copy of the weight stays a parameter."""
    copy = 4 * GATHERED
    for rank in range(W):
        grads, params = world[rank]["gathered"]["grads"], world[rank]["gathered"]["params"]
        assert params["params"] >= copy + W * copy  # the weight and the W copies gathered
        assert grads["params"] < 2 * copy  # the weight only (and nothing gathered)
        assert grads["grads"] >= copy + W * copy  # its gradient and the W gathered from gradient data


def test_the_tensors_of_an_operations_arguments_are_the_ones_torchs_pytree_finds():
    """The tracker reads every operation's arguments and results through its own flat-sequence path: the same
    tensors, in the same order, as the pytree (its reference) finds in any shape an argument comes in."""
    from torch.utils._pytree import tree_leaves

    from harness.measure.memory import tensors_in

    a, b, c = torch.ones(1), torch.zeros(2), nn.Parameter(torch.ones(3))
    shapes = [a, c, [a, b], (a, None, b), [3, 4], torch.Size([2, 3]), [a, [b, c]], (a, (b, 2)), {"k": a, "v": [b]}]
    shapes += [None, 3, 2.5, "x", torch.float32, torch.device("cpu"), [], ()]
    for x in shapes:
        assert [id(t) for t in tensors_in(x)] == [id(t) for t in tree_leaves(x) if isinstance(t, torch.Tensor)], x


def test_two_windows_on_one_model_and_then_its_release_leave_the_process_running():
    """A tracker's weak-keyed records of the model's storages and modules end with its window: left to the collector,
    a dead tracker's weak references on a model a later window tracked crashed the process (a segfault in CPython's
    weakref clearing) when the model was freed. In a child process, which a crash would end with a signal."""
    import subprocess
    import sys

    code = """
import torch
from harness.measure import PeakMemory
from harness.train.models import get_model_spec


def two_windows():
    spec = get_model_spec("tinylm")
    torch.manual_seed(0)
    model = spec.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = spec.make_batch(8, 1, 0)

    def step():
        spec.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        window = PeakMemory(model, optimizer, "cpu")
        window.__enter__()
        step()
        window.__exit__(None, None, None)


two_windows()
print("released")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "released" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_peak_sees_a_known_temporary():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n = 250_000
    with PeakMemory(model, opt, "cpu") as pm:
        tmp = torch.zeros(n)  # 1 MB, freed before the step
        del tmp
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    res = pm.result()
    assert res["activations"] >= 4 * n
    assert res["peak"] >= 4 * n + (16 + 4) * 4  # the temporary and the parameters


def test_a_tensor_made_where_a_freed_one_lived_counts_as_new():
    """The tracker keys the storages it knows by their address (of torch's storage object); a storage made where a
    freed one lived, as the allocator does within a few allocations, is the new one's memory, not the dead one's
    record: tensors alive together after many that died peak at their sum, each counted once."""
    model = nn.Linear(4, 4, bias=False)
    n, kept = 1000, 5
    freed = set()
    with PeakMemory(model, None, "cpu") as pm:
        for _ in range(50):
            tmp = torch.empty(n)
            freed.add(tmp.untyped_storage()._cdata)
            del tmp
        alive = [torch.empty(n) for _ in range(kept)]
        reused = sum(t.untyped_storage()._cdata in freed for t in alive)
        del alive
    assert pm.result()["peak"] == kept * 4 * n + 16 * 4, f"{reused} of {kept} made where a freed one lived"


# ------------------------------------------------------------------ planner


def test_plan_memory_scales_by_world_size():
    from harness.plan.memory import fsdp2_wrap, plan_memory

    widths = (64, 64, 64, 64)
    sizes = [1, 2, 4, 8]
    rows = plan_memory(lambda: mlp(widths), fsdp2_wrap, sizes, "adamw")
    assert [r["world_size"] for r in rows] == sizes
    for r in rows:
        w = r["world_size"]
        assert r["mode"] == "meta-state"
        assert r["params"] == r["grads"] == dim0_padded_bytes(widths, w) // w
        assert r["reduction"] == pytest.approx(w, rel=0.02)


def test_plan_memory_fake_step_gives_peak_that_falls():
    from harness.plan.memory import fsdp2_wrap, plan_memory

    widths = (32, 64, 64, 32)
    rows = plan_memory(lambda: mlp(widths), fsdp2_wrap, [1, 4], "adamw", make_batch=lambda: torch.randn(2, widths[0]))
    assert [r["mode"] for r in rows] == ["fake-step", "fake-step"], [r["note"] for r in rows]
    w1, w4 = rows
    assert w1["params"] == full_bytes(widths) and w4["params"] == full_bytes(widths) // 4
    assert 0 < w4["peak_peak"] < w1["peak_peak"]
    assert w1["peak_peak"] >= w1["state_total"]
