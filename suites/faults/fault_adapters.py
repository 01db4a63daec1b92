"""Adapters that break on purpose: ``--impl suites.faults.fault_adapters:<name>``.

Each one is ``fsdp_impl`` (the real sharded implementation) with one fault injected on a chosen
rank at a chosen training step. The step is counted by the adapter itself (forward calls), so a
fault at step 2 means: step 1 trained normally on every rank. Names:

    init_rank1       rank 1 raises in wrap()             (model init / sharding)
    forward_rank1    rank 1 raises in forward            at step 2
    backward_rank0   rank 0 raises in backward           at step 2
    step_rank1       rank 1 raises in optimizer.step()   at step 2
    adapter_rank1    rank 1 raises in full_params()      after step 2 (the adapter's own code)
    crash_rank1      rank 1 exits (os._exit(9)) in forward at step 2, no traceback at all
    hang_rank1       rank 1 enters an all_reduce that rank 0 skips, after backward at step 2
    forward_rank0    rank 0 raises in forward at step 2 (for world size 1)
    forward_rank1_step3  rank 1 raises in forward at step 3, after the memory-measured step
    nan_loss         every rank: gradients become NaN at step 2 -> NaN parameters, NaN loss at step 3
    nan_param        every rank: gradients become NaN at the last step (3) -> NaN parameters only
    disk_full        every rank: torch.save and the packed tensor files fail as on a full temp dir (ENOSPC) from
                     wrap() on

The raising functions are named after their phase (``raise_in_forward`` ...) and the exception
text says phase, rank and step, so a test can check that the report points at the right place.
``torchrun_main`` (``python -m suites.faults.fault_adapters`` under torchrun) runs a small matrix
through ``harness.phases.run_matrix_under_torchrun``.
"""

from __future__ import annotations

import errno
import os

import torch
import torch.distributed as dist
from torch import nn

from harness.adapters.fsdp_impl import FsdpImplAdapter

FAULT_STEP = 2  # the step where step-wise faults fire; tests run 3 steps
NAN_PARAM_STEP = 3  # nan_param fires at the last step of a 3-step scenario


class FaultInjected(RuntimeError):
    """Raised by a fault adapter; the message names phase, rank and step."""


class FaultAdapter(FsdpImplAdapter):
    """fsdp_impl with one fault. ``phase``: init | forward | backward | step | adapter | crash |
    hang | nan. ``rank``: the rank that faults (None: every rank). ``step``: when."""

    def __init__(self, phase: str, rank: int | None, step: int = FAULT_STEP):
        self.phase, self.fault_rank, self.fault_step = phase, rank, step
        self.name = f"fault-{phase}" + ("" if rank is None else f"-rank{rank}")

    def _mine(self) -> bool:
        return self.fault_rank is None or self.fault_rank == self.rank

    def _fault(self, phase: str) -> str:
        return f"injected fault in {phase} on rank {self.rank} at step {self.step}"

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        self.rank, self.step, self.snapshots = dist.get_rank(group), 0, 0
        if self.phase == "hang":  # every rank joins it here; only the hanging rank will use it
            self.side_group = dist.new_group(ranks=dist.get_process_group_ranks(group))
        if self.phase == "init" and self._mine():
            raise_in_init(self)
        wrapped = super().wrap(model, units, group=group, device=device)
        wrapped.register_forward_pre_hook(self._count_step)
        if self.phase in ("forward", "crash"):
            wrapped.register_forward_pre_hook(self._forward_fault)
        if self.phase == "backward":
            wrapped.register_forward_hook(self._backward_fault)
        return wrapped

    def make_optimizer(self, wrapped: nn.Module, *, name: str, lr: float) -> torch.optim.Optimizer:
        optimizer = super().make_optimizer(wrapped, name=name, lr=lr)
        if self.phase == "step":
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: raise_in_optimizer_step(self))
        return optimizer

    def after_backward(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.step != self.fault_step or not self._mine():
            return
        if self.phase == "hang":
            hang_in_skipped_collective(self)
        if self.phase == "nan":
            for p in wrapped.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    def full_params(self, wrapped: nn.Module) -> dict:
        full = super().full_params(wrapped)
        self.snapshots += 1  # call 1 is the initial snapshot; call k + 1 follows step k
        if self.phase == "adapter" and self.snapshots == self.fault_step + 1 and self._mine():
            raise_in_full_params(self)
        return full

    # -- hooks ----------------------------------------------------------------------------

    def _count_step(self, module, args) -> None:
        self.step += 1

    def _forward_fault(self, module, args) -> None:
        if self.step == self.fault_step and self._mine():
            if self.phase == "crash":
                os._exit(9)  # as a segfault or the OOM killer would: no traceback, no reply
            raise_in_forward(self)

    def _backward_fault(self, module, args, output):
        if self.step == self.fault_step and self._mine():
            return _RaiseInBackward.apply(output, self._fault("backward"))
        return output


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, message):
        ctx.message = message
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise_in_backward(ctx.message)


def raise_in_init(adapter: FaultAdapter) -> None:
    raise FaultInjected(adapter._fault("init (wrap)"))


def raise_in_forward(adapter: FaultAdapter) -> None:
    raise FaultInjected(adapter._fault("forward"))


def raise_in_backward(message: str) -> None:
    raise FaultInjected(message)


def raise_in_optimizer_step(adapter: FaultAdapter) -> None:
    if adapter.step == adapter.fault_step and adapter._mine():
        raise FaultInjected(adapter._fault("optimizer step"))


def raise_in_full_params(adapter: FaultAdapter) -> None:
    raise FaultInjected(adapter._fault("full_params"))


def hang_in_skipped_collective(adapter: FaultAdapter) -> None:
    """An all_reduce that no other rank enters: this rank waits in it forever; the others go on
    to their next collective on the training group and wait there for this rank."""
    dist.all_reduce(torch.ones(1), group=adapter.side_group)


init_rank1 = FaultAdapter("init", rank=1, step=0)
forward_rank1 = FaultAdapter("forward", rank=1)
backward_rank0 = FaultAdapter("backward", rank=0)
step_rank1 = FaultAdapter("step", rank=1)
adapter_rank1 = FaultAdapter("adapter", rank=1)
crash_rank1 = FaultAdapter("crash", rank=1)
hang_rank1 = FaultAdapter("hang", rank=1)
forward_rank0 = FaultAdapter("forward", rank=0)  # at world size 1 (see scenario_after_fault)
forward_rank1_step3 = FaultAdapter("forward", rank=1, step=3)  # after the measured step (see test_torchrun)


class DiskFullAdapter(FsdpImplAdapter):
    """fsdp_impl on a temp dir that fills up: from wrap() on, every file the rank writes with torch.save or as
    packed tensors (harness.train.params_file: the snapshots, the gradient digests) fails as on a full disk
    (ENOSPC), so rank 0's first parameter snapshot cannot be written."""

    def wrap(self, model: nn.Module, units: list[nn.Module], *, group, device) -> nn.Module:
        from harness.train import params_file

        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def open_full(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                full()
            return open(file, mode, *args, **kwargs)

        # this worker's world ends with the run: nothing else uses them after
        torch.save = full
        params_file.open = open_full  # the module's own name for open: its writes only
        return super().wrap(model, units, group=group, device=device)


disk_full = DiskFullAdapter()
nan_loss = FaultAdapter("nan", rank=None, step=FAULT_STEP)
nan_param = FaultAdapter("nan", rank=None, step=NAN_PARAM_STEP)


def scenario_after_fault(ctx, payload: dict) -> dict:
    """A World task: a scenario whose rank raises in forward at step 2 (caught here), then a
    good scenario in the same process, as a torchrun rank goes on after a failed scenario."""
    import dataclasses

    from harness.core.scenario import Scenario
    from harness.train.task import train_scenario

    out = {}
    for label, impl in (("faulty", f"{__name__}:forward_rank0"), ("next", "fsdp_impl")):
        sc = Scenario(impl, "mlp", ctx.world_size, "replicated", "adamw", steps=3)
        try:
            train_scenario(ctx, {"scenario": dataclasses.asdict(sc), "snapshot_dir": payload})
            out[label] = "ok"
        except Exception as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def warm_up(ctx, payload) -> int:
    """A World task: import what a scenario imports, so that a short timeout measures the fault."""
    import fsdp_impl  # noqa: F401
    import harness.train.task  # noqa: F401

    return ctx.rank


def torchrun_main(argv: list[str] | None = None) -> int:
    """Run a small matrix with run_matrix_under_torchrun; rank 0 writes the outcome as JSON.

    ``torchrun --standalone --nproc_per_node=2 -m suites.faults.fault_adapters OUT.json TIMEOUT
    SPEC...`` where SPEC is ``impl@world_size`` (``fsdp_impl@2``, ``forward_rank1@2``; a bare
    name is looked up in this module). Every rank also writes its pid next to OUT.
    """
    import argparse
    import json
    from pathlib import Path

    from harness.core.scenario import Scenario
    from harness.phases import run_matrix_under_torchrun

    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("timeout", type=float)
    p.add_argument("specs", nargs="+")
    ns = p.parse_args(argv)
    rank = int(os.environ["RANK"])
    ns.out.with_name(f"pid-rank{rank}").write_text(str(os.getpid()))
    scenarios = []
    for spec in ns.specs:
        impl, _, ws = spec.partition("@")
        if impl not in ("reference", "fsdp_impl") and ":" not in impl:
            impl = f"suites.faults.fault_adapters:{impl}"
        scenarios.append(Scenario(impl, "mlp", int(ws), "replicated", "adamw", steps=3))
    res = run_matrix_under_torchrun(scenarios, timeout_s=ns.timeout)
    if res is not None:
        sc = res.tables["scenarios"]
        ns.out.write_text(
            json.dumps(
                {
                    "status": dict(zip(sc.scenario, sc.status)),
                    "error": dict(zip(sc.scenario, sc.error)),
                    "verdicts": [v.as_dict() for v in res.verdicts],
                    "groups_built": res.worlds_started,
                    "steps": res.tables["steps"][
                        ["scenario", "step", "loss", "grad_norm", "max_diff_ref", "max_diff_ws1"]
                    ].to_dict("records"),
                },
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(torchrun_main())
