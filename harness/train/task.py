"""The task every rank runs for one scenario: build, wrap, train, record plain data.

Rank 0 writes the full parameters after every step to ``<snapshot_dir>/<scenario id>/step<k>.pt``
(step 0 = initial weights); the parent compares trajectories after the world is done, so no
process holds the reference model while it trains and measures (feature eval: rank 0 evaluates the
plain model at its snapshots once the run is done, harness.train.plain_eval).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

from harness.adapters import load_adapter
from harness.adapters.base import declared_settings, sharded_state
from harness.core.costs import Stopwatch
from harness.core.features import clip_of, has, shard_size
from harness.core.policy import Bounds
from harness.core.scenario import Scenario
from harness.core.scratch import writing_into
from harness.measure import CommCounter, PeakMemory
from harness.measure.applied import AppliedGradients
from harness.measure.census import Census
from harness.measure.layout import rows_held
from harness.measure.memory import local_tensor, optimizer_list
from harness.measure.optim_state import param_names, save_held_state
from harness.measure.timeline import UnitTimeline
from harness.train.checkpointing import Checkpointing
from harness.train.data import eval_batch, global_batch, local_slice
from harness.train.features import checkpoint_units, evaluate, forward_backward, wrap_for
from harness.train.jitter import Jitter
from harness.train.models import get_model_spec
from harness.train.nonfinite import add_first_nonfinite
from harness.train.plain_eval import add_plain_eval_losses, held_out_cut
from harness.train.records import Snapshots, StepFigures, write_gradient_digest
from harness.train.trace import StepTracer
from harness.train.user_models import check_batch, check_built

MEASURED_STEP = 1  # memory is measured on the second step: optimizer state exists by then


def train_scenario(ctx, payload: dict) -> dict:
    """Entry point for World.call("harness.train.task:train_scenario", payload)."""
    sc = Scenario(**payload["scenario"])
    snap_dir = Path(payload["snapshot_dir"]) / sc.id
    costs = Stopwatch()  # where this rank's time went (harness.bench.harness_cost)
    t0 = time.perf_counter()
    # snapshots and checkpoints go to the run's temp dir: a full or refusing one ends the run in one line
    with writing_into(payload["snapshot_dir"]):
        if ctx.rank == 0:
            snap_dir.mkdir(parents=True, exist_ok=True)
        spec = get_model_spec(sc.model)
        adapter = load_adapter(sc.impl)
        ckpt = Checkpointing(payload, snap_dir, ctx.rank)
        # what the process holds before the scenario is not the scenario's
        with Census(ctx.device, keep_frozen=True) as census:
            # the ranks of the harness's own worlds share the run's folder; a torchrun job over several nodes does not
            own_digest = payload.get("ranks_share_dir", True)
            res = _train(ctx, sc, spec, adapter, census, snap_dir, ckpt, payload.get("trace"), costs, own_digest)
        with costs.part("after"):
            if ctx.rank == 0 and has(sc.feature, "eval"):  # after the run: nothing of it is measured
                add_plain_eval_losses(sc, spec, snap_dir, res["steps"], ctx.device)
            if ctx.rank == 0:  # a non-finite loss: the module that first gave a non-finite output (nothing otherwise)
                add_first_nonfinite(sc, spec, snap_dir, res["steps"], ctx.device)
        costs.add("total", time.perf_counter() - t0)
        res["costs"] = costs.seconds
        return res


def _train(
    ctx,
    sc: Scenario,
    spec,
    adapter,
    census: Census,
    snap_dir: Path,
    ckpt: Checkpointing,
    trace: dict | None = None,
    costs: Stopwatch | None = None,
    own_digest: bool = True,
) -> dict:
    """The scenario's training on this rank. `costs`: seconds by part (setup, steps, measured_step, grad_norm,
    census, snapshots, exchange, align, checkpoints). `own_digest`: each rank writes its part of the gradient
    digest into the run's folder (harness.train.records)."""
    costs = costs or Stopwatch()
    setup_t0 = time.perf_counter()
    device = ctx.device
    torch.manual_seed(sc.seed)
    model = spec.build()
    units = spec.units(model)
    check_built(sc.model, model, units)  # a user's model is held to the protocol, one line if it is not
    model = model.to(device)
    sizes = _param_bytes(model, units)
    timeline = UnitTimeline(model, units)  # found on the plain model, looked at while the wrapped one trains
    # the localiser's replay: every op of the steps up to trace["steps"] (harness.localize)
    tracer = StepTracer(model, units, trace["keep_bytes"], trace.get("pass_grads", False)) if trace else None
    if has(sc.feature, "ac"):
        checkpoint_units(units)
    wrapped = wrap_for(sc.feature, adapter, model, units, ctx=ctx)
    optimizer = adapter.make_optimizer(wrapped, name=sc.optimizer, lr=sc.lr)
    names = param_names(model, wrapped)  # the plain model's names for the parameters the wrapped one holds

    def write_state(path: Path) -> None:  # the optimizer state every rank holds (ckpt: saved, restored)
        read = getattr(adapter, "optimizer_state", None)  # an engine's partitions, per model parameter
        whole = read(wrapped, optimizer) if callable(read) else None
        save_held_state(census.optimizers(optimizer), names, ctx, path, own=len(optimizer_list(optimizer)), whole=whole)

    with costs.part("checkpoints"):
        steps = ckpt.resume(adapter, wrapped, optimizer, write_state)  # the saver's step records (ckpt), else []
    costs.add("setup", time.perf_counter() - setup_t0 - costs.seconds["checkpoints"])
    snapshots = Snapshots(ctx, snap_dir)
    with costs.part("snapshots"):
        snapshots.take(adapter, wrapped, len(steps))
    with costs.part("checkpoints"):
        ckpt.save_after(
            len(steps), adapter, wrapped, optimizer, steps, write_state
        )  # a checkpoint of the initial state
    sync = getattr(adapter, "set_gradient_sync", None)  # a capability (harness/adapters/base.py)
    set_sync = (lambda enabled: sync(wrapped, enabled)) if callable(sync) else None
    engine = Engine(adapter, wrapped, optimizer)  # the adapter's engine hooks, else the harness's own step
    # an engine keeps its reduced gradient in buffers of its own: read where its optimizer applies it
    applied = AppliedGradients(census.optimizers(optimizer)) if engine.drives else None
    start = len(steps)
    # the ranks whose parts make up one copy of the model: every rank's shard, or one replica's (hsdp)
    first_copy = ctx.rank < shard_size(sc.feature, ctx.world_size)
    measured = max(MEASURED_STEP, start) + 1  # a resumed run measures its first step
    adds_up = adapter.sharded and ctx.world_size > 1  # shards' squared norms add up; copies are all equal
    figures = StepFigures(ctx, split=sc.data_mode == "split", adds_up=adds_up)

    comm_totals, memory, times, gathered = {}, {}, [], []
    for step in range(start + 1, sc.steps + 1):
        inputs, targets = global_batch(spec, sc.global_batch, step, sc.seed)
        check_batch(sc.model, (inputs, targets), sc.global_batch)
        x, y, idx = local_slice(inputs, targets, ctx.rank, ctx.world_size, sc.data_mode)
        x, y = x.to(device), y.to(device)
        held_out = _held_out(sc, spec, step, ctx) if has(sc.feature, "eval") else []
        # the harness's own tensors, not the implementation's
        batch = (inputs, targets, x, y, idx, *(t for xy in held_out for t in xy))
        measure_mem = step == measured
        traced = tracer is not None and step <= trace["steps"]
        if traced:
            tracer.begin_step(step, wrapped, trace.get("force_dir"))
        # replicated data: every rank computes the same gradient, so what each puts into a reduction is compared
        counter = CommCounter(
            fingerprint=sc.data_mode == "replicated" and ctx.world_size > 1 and not has(sc.feature, "hsdp")
        )
        mem = None
        if measure_mem:  # the peak tracker also counts what the implementation holds outside model and optimizer
            with costs.part("census"):
                optimizers = census.optimizers(optimizer)  # the adapter's and any inside it
                if sc.peak_is_read():
                    held_elsewhere = [
                        t
                        for cat, _, t in census.classify(wrapped, optimizers, (*batch, *snapshots.tensors()))
                        if cat == "other"
                    ]
                    mem = PeakMemory(wrapped, optimizers, device, extra=held_elsewhere, on_moment=timeline.sample)
                    del held_elsewhere  # the tracker holds them weakly; a strong reference here would keep them alive
        _sync(device)
        if step == start + 1 or measure_mem:
            with costs.part("align"):
                _align(ctx)
        t0 = time.perf_counter()
        # The tracker (a dispatch mode plus global module hooks) is left on every path: a step that
        # raises must not leave it installed for the next scenario in this process.
        mark = _marker(timeline, mem)
        mark = tracer.marking(mark) if traced else mark
        eval_losses = []
        # timing perturbation (jitter): delays at the collectives, the waits, after forward, before the step
        jitter = Jitter(sc.seed, ctx.rank, step) if has(sc.feature, "jitter") else None
        mark = jitter.marking(mark) if jitter is not None else mark
        with counter, mem if mem is not None else contextlib.nullcontext(), jitter or contextlib.nullcontext():
            with tracer if traced else contextlib.nullcontext():
                summed = traced and trace.get("slices_summed", False)
                loss = forward_backward(
                    sc.feature,
                    spec,
                    wrapped,
                    x,
                    y,
                    mark,
                    set_sync,
                    micro=sc.micro_batches,
                    reverse=sc.reverse_micro,
                    slices_summed=summed,
                    backward=engine.backward,
                    micro_step=engine.micro_step,
                )
                adapter.after_backward(wrapped, optimizer)
                mark("after_backward")
                if traced:
                    tracer.end_backward(wrapped, divide_by=sc.micro_batches if summed else 1)
                with costs.part("grad_norm"):  # inside the step's window: the bench takes it out
                    grad_sq = _local_grad_sq(wrapped) if first_copy else 0.0  # before clipping: measured by the harness
                clip_norm = math.nan if engine.clips else clip_for(adapter, wrapped, sc.feature, sc.nudge)
                if sc.nudge and clip_of(sc.feature) is None:  # a user optimizer's nudged probe
                    nudge_grads(optimizer, sc.nudge)
                if traced and clip_of(sc.feature) is not None:
                    tracer.end_clip(wrapped)
                if traced:  # the localiser's yardstick: the run's own gradients into its optimizer
                    tracer.force_grads(wrapped, trace.get("force_dir"))
                mark("optimizer")
                if jitter is not None:
                    jitter.pause("optimizer")
                engine.step()
                mark("optimizer")
                if applied is not None:
                    applied_sq, applied_max, applied_values = applied.take()
                    grad_sq = applied_sq if first_copy else 0.0
                if traced:
                    tracer.end_step(wrapped)
            if held_out:  # inside the measured window: the timeline and the peak see it
                eval_losses = evaluate(sc.feature, spec, wrapped, held_out, mark)
        _sync(device)
        if not measure_mem:
            times.append(time.perf_counter() - t0)
            costs.add("steps", times[-1])
        else:
            costs.add("measured_step", time.perf_counter() - t0)
            census_t0 = time.perf_counter()
            memory = dict(mem.result()) if mem is not None else {}  # the peak where a verdict reads it
            # a comm thread may still hold a buffer of a collective that ran: none ran, none to wait for
            held = census.held(
                wrapped,
                optimizers,
                exclude=(*batch, loss, *([applied_values] if applied is not None else []), *snapshots.tensors()),
                settle=bool(counter.summary()),
                tolerated=Bounds.held_elsewhere_bytes,
            )
            memory.update({f"state_{k}": v for k, v in held.items()})
            # the ZeRO-3 state (what the gate compares across runs); buffers and other are rows of their own
            # (on a device, wherever it lives: state offloaded to the host counts as much as state on the device)
            memory["state_total"] = sum(
                held.get(p + c, 0) for p in ("", "host_") for c in ("params", "grads", "optimizer_state")
            )
            gathered = timeline.records() if mem is not None else []
            costs.add("census", time.perf_counter() - census_t0)
        exchange_t0 = time.perf_counter()
        if sc.data_mode == "replicated":  # the gradient the optimizer applied, its digest
            mine = first_copy and (adapter.sharded or ctx.rank == 0)
            # passed, not kept: a copy alive into the next step would read as held by the implementation
            write_gradient_digest(
                (applied_values if mine else torch.zeros(0))
                if applied is not None
                else _optimizer_grads(optimizer, mine),
                ctx,
                snap_dir,
                step,
                own_digest,
            )
        # the harness's copy of the applied gradients, dropped before the next step's census would count it held
        applied_values = None
        if engine.clips and clip_of(sc.feature) is not None:  # the norm it applied, after its own clipping
            clip_norm = _applied_norm(
                clip_of(sc.feature)[0], applied_sq if first_copy else 0.0, applied_max, adds_up, ctx
            )
        replicas_differ = _replicas_differ(wrapped, sc, ctx)
        costs.add("exchange", time.perf_counter() - exchange_t0)
        engine.zero_grad()
        for row in counter.summary():
            tot = comm_totals.setdefault(
                (row["collective"], row["dtype"], row["ranks"]), {"calls": 0, "elements": 0, "bytes": 0}
            )
            for k in tot:
                tot[k] += row[k]
        record = {
            "step": step,
            "clip_norm": clip_norm,
            "jitter_delays": jitter.delays if jitter is not None else 0,
            "jitter_s": jitter.slept if jitter is not None else 0.0,
            "reduction_inputs": list(counter.reduction_inputs) if counter.fingerprint else None,
            "replicas_differ": replicas_differ,
        }
        # this rank's own figures; the global ones are settled in batches (harness.train.records)
        figures.add(record, float(loss.detach()), grad_sq, _own_eval_loss(eval_losses) if held_out else math.nan)
        steps.append(record)
        with costs.part("snapshots"):
            snapshots.take(adapter, wrapped, step)
        if ckpt.saves_after(step):
            with costs.part("exchange"):
                figures.settle()  # the checkpoint keeps the records
        with costs.part("checkpoints"):
            ckpt.save_after(step, adapter, wrapped, optimizer, steps, write_state)
    with costs.part("exchange"):
        figures.settle()
    with costs.part("snapshots"):
        snapshots.flush()

    if applied is not None:
        applied.remove()
    if tracer is not None:
        (snap_dir / "trace").mkdir(parents=True, exist_ok=True)
        tracer.save(snap_dir / "trace" / f"rank{ctx.rank}.pt")
    trained = max(1, sc.steps - start)  # the steps this run trained itself
    comm = [
        {"collective": c, "dtype": d, "ranks": r, **{k: v / trained for k, v in tot.items()}}
        for (c, d, r), tot in sorted(comm_totals.items())
    ]
    return {
        "scenario": sc.id,
        "rank": ctx.rank,
        "steps": steps,
        "memory": memory,
        "comm": comm,
        "gathered": gathered,
        "sharded": bool(adapter.sharded),
        "sharded_state": ",".join(sharded_state(adapter)),
        "engine_clips": engine.clips,
        "rows": rows_held(wrapped),
        **sizes,
        "step_time_s": sum(times) / len(times) if times else math.nan,
        "snapshot_dir": str(snap_dir),
    }


class Engine:
    """The step's backward, optimizer step and zeroing: the adapter's engine hooks where it has them (an
    implementation that drives its own step, harness/adapters/base.py), else the harness's own (the micro-batch's
    loss / micro-batches backward, optimizer.step(), optimizer.zero_grad())."""

    def __init__(self, adapter, wrapped, optimizer):
        self.adapter, self.wrapped, self.optimizer = adapter, wrapped, optimizer
        hook = lambda name: getattr(adapter, name, None) if callable(getattr(adapter, name, None)) else None  # noqa: E731
        self._backward, self._step, self._zero_grad = hook("backward"), hook("step"), hook("zero_grad")
        self.backward = (lambda loss: self._backward(wrapped, loss)) if self._backward else None
        self.micro_step = (lambda: self._step(wrapped, optimizer)) if self._step else None
        self.drives = self._step is not None
        # an engine that declares the clipping clips inside its step: the harness asks nothing of it
        self.clips = self.drives and "clipping" in declared_settings(adapter)

    def step(self) -> None:
        if self._step is not None:
            self._step(self.wrapped, self.optimizer)
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        if self._zero_grad is not None:
            self._zero_grad(self.wrapped, self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=True)


def _held_out(sc: Scenario, spec, step: int, ctx) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Feature eval: what this rank evaluates after step `step`: its slice of the held-out batch, cut as the
    data mode cuts the training batch (the whole batch with replicated data); a reference that sums the
    micro-batches of `micro_batches` ranks evaluates each of their slices."""
    batch = eval_batch(spec, sc.global_batch, step, sc.seed)
    check_batch(sc.model, batch, sc.global_batch)
    cut = held_out_cut(sc, *batch)
    mine = cut if sc.micro_batches > 1 or len(cut) == 1 else [cut[ctx.rank]]
    return [(x.to(ctx.device), y.to(ctx.device)) for x, y in mine]


def _own_eval_loss(losses: list[float]) -> float:
    """This rank's eval loss: its slice's (settled into the global batch's with split data, harness.train.records),
    or, for a reference that evaluates the slices of `micro_batches` ranks, their means summed exactly (math.fsum,
    as W float32 values add up in float64) over their number."""
    return math.fsum(losses) / len(losses) if len(losses) > 1 else losses[0]


def clip_for(adapter, wrapped, feature: str, nudge: int = 0) -> float:
    """Clip the gradients for a clip feature; the norm before clipping the adapter reports (NaN: none).
    `nudge` (a noise probe's Scenario.nudge): the coefficient max_norm / norm moved by that many ulps."""
    clip = clip_of(feature)
    if clip is None:
        return math.nan
    norm_type, max_norm = clip
    return float(adapter.clip_grad_norm(wrapped, max_norm * (1 + nudge * 2.0**-23), norm_type))


def nudge_grads(optimizer, nudge: int) -> None:
    """A user's optimizer's nudged noise probe (Scenario.is_nudged): every gradient the optimizer reads scaled by
    1 + nudge fp32 ulps, as a clipping coefficient is nudged under clip, so that an update computed from a
    whole-matrix norm changes as a sharded norm summed from W partial sums may change it."""
    with torch.no_grad():
        for opt in optimizer_list(optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(1 + nudge * 2.0**-23)


def _marker(timeline: UnitTimeline, mem: PeakMemory | None):
    """`mark(phase, value)` for the step: the timeline hears where the step is (measured step only)."""
    if mem is None:
        return lambda phase, value=None: value

    def mark(phase: str, value=None):
        if phase in ("forward", "eval"):
            mem.next_forward()
        return timeline.mark(phase, value)

    return mark


def _param_bytes(model, units) -> dict:
    """Full parameter bytes and elements; the largest that one unit (or the root's remainder) holds unsharded; the
    largest child unit and the root's own parameters apart (FSDP2 keeps the root gathered after forward)."""
    nbytes = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    params = list(model.parameters())
    total = nbytes(params)
    elements = {
        "param_elements": sum(p.numel() for p in params),
        "trainable_elements": sum(p.numel() for p in params if p.requires_grad),
    }
    per_unit = [nbytes(u.parameters()) for u in units]
    # one dim-0 row of every tensor: the most per-parameter dim-0 sharding pads per rank
    row_bytes = sum((p.numel() // p.shape[0] if p.dim() else 1) * p.element_size() for p in params if p.numel())
    root = total - sum(per_unit)
    return {
        "param_bytes": total,
        "trainable_bytes": nbytes(p for p in params if p.requires_grad),
        "largest_unit_bytes": max(per_unit + [root]),
        "largest_child_bytes": max(per_unit + [0]),
        "root_bytes": root,
        "row_bytes": row_bytes,
        "param_tensors": len(params),
        "buffer_bytes": nbytes(model.buffers()),
        "batch_stats": batch_stat_layers(model),
        **elements,
    }


def batch_stat_layers(model) -> str:
    """The plain model's layers that normalise by the statistics of the batch they are given in training
    (BatchNorm; SyncBatchNorm's statistics span the ranks), comma-separated: with split data they see a
    rank's slice, not the full batch (harness/core/policy.py BATCH_STATS_SPLIT)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return ",".join(
        name
        for name, m in model.named_modules()
        if isinstance(m, _BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
    )


def _optimizer_grads(optimizer, mine: bool) -> torch.Tensor:
    """The gradient values this rank's optimizer applied (fp32, CPU, flat); none where `mine` is
    False (an unsharded implementation's other ranks hold copies of rank 0's)."""
    grads = (
        [
            local_tensor(p.grad).detach().reshape(-1).to("cpu", torch.float32)
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        if mine
        else []
    )
    return torch.cat(grads) if grads else torch.zeros(0)


def _replicas_differ(wrapped, sc: Scenario, ctx) -> float:
    """Hybrid sharding: how many ranks hold parameters (their own parts, as they hold them) that differ
    bit for bit from the first replica's rank with the same index, which must hold the same; NaN for
    any other feature. Read from every rank, so a replica that drifts shows even when the parameters
    the adapter reports come from the first replica alone."""
    shard = shard_size(sc.feature, ctx.world_size)
    if not has(sc.feature, "hsdp") or shard == ctx.world_size:
        return math.nan
    digest = hashlib.blake2b(digest_size=16)
    for p in wrapped.parameters():
        # a copy: a numpy view would make the implementation's own storage non-resizable (FSDP2's root, left
        # unsharded after an eval forward, then fails to free it in the next backward)
        digest.update(local_tensor(p).detach().to("cpu", copy=True).reshape(-1).view(torch.uint8).numpy().tobytes())
    every = [None] * ctx.world_size
    dist.all_gather_object(every, digest.hexdigest(), group=ctx.group)
    return float(sum(every[r] != every[r % shard] for r in range(ctx.world_size)))


def _applied_norm(norm_type: float, sq: float, amax: float, adds_up: bool, ctx) -> float:
    """The global norm of the gradient an engine applied (after its clipping), in the clipping's norm type, the same
    on every rank: the squared norms of the ranks' parts summed where they add up (`sq`: the rank's part of one
    copy), or the largest |element| over the ranks."""
    if ctx.world_size > 1 and (norm_type != 2 or adds_up):
        t = torch.tensor([sq if norm_type == 2 else amax], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if norm_type == 2 else dist.ReduceOp.MAX, group=ctx.group)
        sq = amax = float(t[0])
    return math.sqrt(sq) if norm_type == 2 else amax


def _local_grad_sq(model) -> float:
    """The squared L2 norm of the gradients this rank holds, in float64: the gradients of a device and dtype
    concatenated in groups of at most the largest one's size, one dot product a group (a few operations, not three
    per parameter). It runs inside the measured step: a group's float64 copy is no larger than the one a
    per-parameter sum would make of the largest gradient (what a device's allocator peak sees), and the step's
    trackers (its peak, the localiser's ops) do not see these reads at all."""
    with _disable_current_modes():
        return _grad_sq(model)


def _grad_sq(model) -> float:
    parts: dict[tuple, list[torch.Tensor]] = {}  # by (device, dtype): an offloaded gradient lives on the host
    for p in model.parameters():
        if p.grad is not None:
            g = local_tensor(p.grad).detach()
            parts.setdefault((g.device, g.dtype), []).append(g.reshape(-1))
    largest = max((g.numel() for grads in parts.values() for g in grads), default=0)
    total = 0.0
    for grads in parts.values():
        group: list[torch.Tensor] = []
        size = 0  # the group's elements, kept as it grows (not summed again for every gradient)
        for i, g in enumerate(grads):
            group.append(g)
            size += g.numel()
            if i + 1 == len(grads) or size + grads[i + 1].numel() > largest:
                flat = (group[0] if len(group) == 1 else torch.cat(group)).double()
                total += float(torch.dot(flat, flat))
                group, size = [], 0
    return total


def _align(ctx) -> None:
    """W > 1: the ranks start the run's first step, and the measured one, together (a barrier, before anything of
    the step is counted or measured): the set-up and the memory census take each rank its own time. Between the
    other steps the harness gives rank 0 no more work than the others (the snapshots are written in batches, the
    figures settled in batches), so that a run without the jitter feature stays the calm one."""
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
