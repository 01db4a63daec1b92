"""Upper limits of a run, derived from this machine and the models, checked before anything runs.

Each is a usage error naming the limit and how it follows; `--allow-large` lifts them (the run then
goes on at its own risk). They catch sizes that cannot work here, not slow ones:

- world size: W ranks are W processes on this machine, each a worker with torch loaded
  (`RANK_OVERHEAD_BYTES`) that builds the plain model before sharding it and trains it with AdamW
  (`RANK_MODEL_COPIES` x the model's parameter bytes at most, at W = 1). W x that must fit the
  machine's memory (physical, or the cgroup's limit where lower). Under torchrun the ranks are the
  job's, spread over its nodes: the job's size bounds them instead (harness.execute.torchrun).
- steps: rank 0 of every scenario writes the full parameters after every step (and, with replicated
  data, the gradient values) into the temp dir, kept until the run's tables are built; the files of
  all scenarios must fit the free space there. Each file's size is the model's parameter bytes plus
  what its format adds (harness.train.params_file), measured on the model's own parameter names.
- planner world size (`plan`): above the largest dim 0 of any parameter every rank holds at most one
  row of each, so the per-rank state stops falling: the plan of a larger W is that of this one,
  while the planner's time and memory keep growing with W (FSDP2 keeps per-rank lists per parameter).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
from dataclasses import dataclass

# Private memory of a world worker after a scenario, from /proc/<pid>/smaps_rollup Private_Dirty (the rest
# of its resident memory is shared with the forkserver that preloaded torch); measured on CPU:
# reports/performance.md#other-commands-of-the-docs
RANK_OVERHEAD_BYTES = 97 * 2**20
# the plain model built before sharding, its gradients, and AdamW's two moments: what a rank holds at
# W = 1 (or under an unsharded implementation such as DDP at any W)
RANK_MODEL_COPIES = 4
ALLOW = "--allow-large to run it anyway"


@dataclass(frozen=True)
class ModelSize:
    param_bytes: int  # every parameter once, at its dtype
    trainable_bytes: int
    snapshot_bytes: int  # one file of the full parameters in fp32, as rank 0 writes it per step
    largest_rows: int  # the largest dim 0 of any parameter


def model_size(name: str) -> ModelSize:
    """The model's sizes, built on the meta device (no memory), or on the CPU where it cannot be."""
    import torch

    from harness.train.models import get_model_spec
    from harness.train.params_file import save_params

    build = get_model_spec(name).build
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"), _no_fills_on_meta():
                model = build()
        except Exception:  # not meta-safe: build it for real
            model = build()
    params = dict(model.named_parameters())
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    buf = io.BytesIO()  # what the snapshot's format adds: the names, shapes and records, one element each
    save_params({k: torch.zeros(1) for k in params}, buf)
    snapshot = len(buf.getvalue()) + 4 * sum(p.numel() - 1 for p in params.values())
    return ModelSize(
        nbytes(params.values()),
        nbytes(p for p in params.values() if p.requires_grad),
        snapshot,
        max((p.shape[0] if p.dim() else 1) for p in params.values()),
    )


# in-place ops that only write values (nn.init's fills, and the arithmetic of trunc_normal_): on a meta
# tensor they have nothing to write and leave its shape as it was
_VALUE_FILLS = frozenset(
    {
        "normal_",
        "uniform_",
        "fill_",
        "zero_",
        "random_",
        "exponential_",
        "bernoulli_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "erfinv_",
        "mul_",
        "add_",
        "sub_",
        "div_",
        "clamp_",
        "copy_",
    }
)


def _no_fills_on_meta():
    """A torch function mode in which value fills of a meta tensor return it at once. A meta tensor's fill
    runs through torch._refs, whose first call imports torch._dynamo: a cost to every CLI and pytest start
    (reports/performance.md#imports), in a process that wants only the model's sizes."""
    import torch
    from torch.overrides import TorchFunctionMode

    class NoFills(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
            if getattr(func, "__name__", "") in _VALUE_FILLS and isinstance(target, torch.Tensor) and target.is_meta:
                return target
            return func(*args, **kwargs)

    return NoFills()


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit where that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            physical = min(physical, int(text))
    return physical


def _gib(n: float) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def check_world_sizes(world_sizes, sizes: dict[str, ModelSize]) -> None:
    """The largest world size must fit this machine's memory (module docstring)."""
    largest = max(sizes.values(), key=lambda s: s.param_bytes)
    per_rank = RANK_OVERHEAD_BYTES + RANK_MODEL_COPIES * largest.param_bytes
    memory = machine_memory_bytes()
    most = memory // per_rank
    if max(world_sizes) > most:
        raise argparse.ArgumentTypeError(
            f"--world-sizes {max(world_sizes)}: at most {most} ranks fit this machine's memory ({_gib(memory)} / "
            f"{_gib(per_rank)} per rank: a worker with torch loaded, {_gib(RANK_OVERHEAD_BYTES)}, + "
            f"{RANK_MODEL_COPIES} x the largest model's {_gib(largest.param_bytes)} of parameters); {ALLOW}"
        )


def run_files_bytes(scenarios, sizes: dict[str, ModelSize], steps: int) -> int:
    """What the run keeps in the temp dir at `steps` steps: every scenario's snapshot of the initial
    parameters and of each step, and with replicated data each step's gradient values."""
    total = 0
    for sc in scenarios:
        size = sizes[sc.model]
        total += (steps + 1) * size.snapshot_bytes
        if sc.data_mode == "replicated":
            total += steps * (size.trainable_bytes + size.snapshot_bytes - size.param_bytes)
    return total


def check_steps(scenarios, sizes: dict[str, ModelSize], steps: int, temp_dir: str) -> None:
    """The run's files at `steps` steps must fit the free space of the temp dir."""
    need = run_files_bytes(scenarios, sizes, steps)
    free = shutil.disk_usage(temp_dir).free
    if need <= free:
        return
    base, per_step = run_files_bytes(scenarios, sizes, 0), run_files_bytes(scenarios, sizes, 1)
    per_step -= base
    most = (free - base) // per_step if free > base else 0
    raise argparse.ArgumentTypeError(
        f"--steps {steps}: the run keeps every step's parameter snapshot of its {len(scenarios)} scenarios in the temp "
        f"dir until it ends, {_gib(per_step)} per step, {_gib(need)} in all; {temp_dir} has {_gib(free)} free, so at "
        f"most {most} steps fit (free space there, set TMPDIR elsewhere, or {ALLOW})"
    )


def check_plan_world_sizes(model: str, world_sizes, size: ModelSize) -> None:
    """A planner world size above the model's largest dim 0 plans nothing new (module docstring)."""
    if max(world_sizes) > size.largest_rows:
        raise argparse.ArgumentTypeError(
            f"--world-sizes {max(world_sizes)}: above {size.largest_rows} ranks ({model}'s largest dim 0) every rank "
            f"holds at most one row of each parameter, so the per-rank state stops falling and the plan is that of "
            f"{size.largest_rows}, while planning time and memory grow with the world size; {ALLOW.replace('run', 'plan')}"
        )
