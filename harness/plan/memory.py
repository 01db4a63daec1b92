"""Memory-only scaling to large world sizes in ONE process, with torch's fake process group.

For each W, rank 0 of a fake W-rank world (``FakeStore`` + backend ``"fake"``: collectives
return at once and move nothing) builds the model without allocating it, wraps it with the
implementation under test, and measures what that rank would hold:

``"meta-state"`` (default, no batch given): the model is built under ``torch.device("meta")``,
    wrapped, given zero gradients shaped like its (sharded) parameters, and stepped once by the
    real optimizer, so the optimizer allocates its real state; `state_bytes` then reads
    params / grads / optimizer state from the storages (meta storages have sizes, no memory).
    No forward/backward runs: FSDP2 refuses to run a module whose parameters are still on the
    meta device ("FSDP parameters should be materialized from meta device before training").
``"fake-step"`` (``make_batch`` given): the model is built under ``FakeTensorMode`` (tensors
    claim a real device but hold no memory), so FSDP2 runs a real forward + backward + optimizer
    step, with its all-gathers through the fake PG. One warm-up step runs first, untracked: in a
    cold process DTensor's sharding propagation allocates full-size fake tensors under the same
    fake mode the tracker watches, which would add a phantom full-size temporary
    (reports/measured_behaviour.md#the-planners-warm-up-step) to the first step. The measured step gives
    `PeakMemory` categories as well.
    If the implementation cannot run under FakeTensorMode (``.item()``, ``data_ptr``, numpy on
    parameter data), the exception is recorded in ``note`` and the plan falls back to meta-state.
If ``build_model`` cannot run on meta, it is built on CPU for real (``note`` says so).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.measure.ideals import ideal_state_bytes
from harness.measure.memory import PeakMemory, local_tensor, state_bytes

__all__ = ["plan_memory", "fsdp2_wrap", "default_units", "make_optimizer", "full_param_bytes"]

STATE = ("params", "grads", "optimizer_state")


def make_optimizer(name: str, params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The harness's own optimizers (``harness.train.optim``), so plans match what training runs."""
    from harness.optimizers import make_optimizer as harness_optimizer

    return harness_optimizer(params, name, lr)


def full_param_bytes(model: nn.Module) -> int:
    """Bytes of the full (unsharded) parameters, each parameter once, from shapes only."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every ModuleList element (transformer blocks) or, if there is none, every direct child
    holding parameters."""
    units = [m for ml in module.modules() if isinstance(ml, nn.ModuleList) for m in ml]
    return units or [c for c in module.children() if any(True for _ in c.parameters())]


def fsdp2_wrap(
    module: nn.Module,
    group: dist.ProcessGroup,
    device_type: str = "cpu",
    units: Callable[[nn.Module], list[nn.Module]] = default_units,
) -> nn.Module:
    """Torch's ``fully_shard`` (FSDP2) on each of ``units(module)``, then on the root."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    with unset_fake_temporarily():  # the mesh reads its rank tensor (.tolist()): keep it real
        mesh = DeviceMesh.from_group(group, device_type)
    with _chunks_on_demand():
        for unit in units(module):
            fully_shard(unit, mesh=mesh)
        fully_shard(module, mesh=mesh)
    return module


# [Note: the planner's chunks on demand] FSDP2 cuts each parameter into W chunks when it shards it
# (``_chunk_with_empty``: torch.chunk, then an empty tensor for each rank past the last row) and reads two of
# them: its own rank's and chunk 0 (the padded size). At W far above a parameter's rows that list is almost all
# empty tensors, one per rank: the planner's time grew with W x the parameter tensors, while the one rank it
# plans holds the same chunk either way. `_chunks_on_demand` has FSDP2 cut only the chunks it reads, each as
# torch.chunk would have cut it (the same rows, sizes and strides; suites/harness/unit/test_plan.py holds the
# plans made both ways equal); where torch no longer has that function, FSDP2 runs as it is.


class _Chunks:
    """torch.chunk(tensor, n, dim) followed by empty chunks up to n, each made when it is read."""

    def __init__(self, tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        rows = tensor.size(dim)
        self.size = -(-rows // n) if n else 0  # torch.chunk's chunk size: ceil(rows / n)
        self.cut = -(-rows // self.size) if self.size else 0  # how many chunks torch.chunk returns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = i + self.n if i < 0 else i
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i >= self.cut:
            return self[0].new_empty(0)
        start = i * self.size
        return self.tensor.narrow(self.dim, start, min(self.size, self.tensor.size(self.dim) - start))

    def __iter__(self):
        return (self[i] for i in range(self.n))


@contextlib.contextmanager
def _chunks_on_demand():
    """FSDP2's chunking made lazy for the planner's wrap (see [Note: the planner's chunks on demand])."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = lambda tensor, num_chunks, dim: _Chunks(tensor, num_chunks, dim)
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


@contextlib.contextmanager
def _fake_world(world_size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "plan_memory needs a process with no default process group "
            "(it creates a fake one per world size); run it outside the workers"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _build(build_model: Callable[[], nn.Module], notes: list[str]) -> nn.Module:
    try:
        with torch.device("meta"):
            return build_model()
    except Exception as e:  # noqa: BLE001 - any failure means "not meta-safe"
        notes.append(f"built on cpu (meta failed: {type(e).__name__}: {e})")
        return build_model()


def _meta_state(build_model, wrap, group, optimizer: str, notes: list[str]) -> dict[str, Any]:
    model = wrap(_build(build_model, notes), group)
    opt = make_optimizer(optimizer, model.parameters())
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    return {"mode": "meta-state", **state_bytes(model, opt)}


def _fake_step(build_model, wrap, group, optimizer: str, make_batch, loss_fn) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = wrap(build_model(), group)
        opt = make_optimizer(optimizer, model.parameters())
        device = local_tensor(next(model.parameters())).device

        def step() -> None:
            loss_fn(model, make_batch()).backward()
            opt.step()

        step()  # warm-up, untracked (see module docstring)
        with PeakMemory(model, opt, device) as pm:
            step()
        out = {"mode": "fake-step", **state_bytes(model, opt)}
        out.update({f"peak_{k}": v for k, v in pm.result().items()})
    return out


def _default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    return out.float().pow(2).mean()


def plan_memory(
    build_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module, dist.ProcessGroup], nn.Module],
    world_sizes: list[int],
    optimizer: str,
    *,
    make_batch: Callable[[], Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Per-rank state bytes (and, with ``make_batch``, peak) for each W, with reductions vs W=1.

    ``wrap(module, group)`` shards ``module`` over ``group`` and returns the model to train
    (e.g. `fsdp2_wrap`, or ``fsdp_impl``'s ``fully_shard(m, process_group=group)``).
    ``make_batch()`` is called under FakeTensorMode; ``loss_fn(model, batch)`` defaults to the
    mean square of the output. Each row: world_size, mode, params, grads, optimizer_state,
    state_total, ideal_state_total (ZeRO-3, padding ignored), {category}_reduction and
    reduction (W=1 value / this value), full_param_bytes, [peak_* categories], seconds, note.
    W=1 is always run (first) as the baseline; it is reported only if asked for.
    """
    try:
        with torch.device("meta"):
            full = full_param_bytes(build_model())
    except Exception:  # noqa: BLE001 - not meta-safe: build for real once
        full = full_param_bytes(build_model())
    rows: list[dict[str, Any]] = []
    for ws in [1] + [w for w in world_sizes if w != 1]:
        t0, notes = time.perf_counter(), []
        with _fake_world(ws) as group:
            row: dict[str, Any] | None = None
            if make_batch is not None:
                try:
                    row = _fake_step(build_model, wrap, group, optimizer, make_batch, loss_fn or _default_loss)
                except Exception as e:  # noqa: BLE001 - recorded, then fall back
                    notes.append(f"fake-step failed: {type(e).__name__}: {e}")
            if row is None:
                row = _meta_state(build_model, wrap, group, optimizer, notes)
        row["state_total"] = sum(row[k] for k in STATE)
        row["ideal_state_total"] = sum(ideal_state_bytes(full, optimizer, ws).values())
        rows.append(
            {
                "world_size": ws,
                "full_param_bytes": full,
                **row,
                "seconds": round(time.perf_counter() - t0, 3),
                "note": "; ".join(notes),
            }
        )
    base = rows[0]
    for row in rows:
        for key in (*STATE, "state_total"):
            name = "reduction" if key == "state_total" else f"{key}_reduction"
            row[name] = base[key] / row[key] if row[key] else (1.0 if not base[key] else float("inf"))
    return [r for r in rows if r["world_size"] in world_sizes]
