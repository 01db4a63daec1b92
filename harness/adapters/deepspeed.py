"""DeepSpeed's ZeRO stages 1, 2 and 3 (``deepspeed_zero1``, ``deepspeed_zero2``, ``deepspeed_zero3``), driven through
DeepSpeed's own engine and configuration, so that its code is what is tested (optional extra
``pip install -e ".[deepspeed]"``; gloo on a CPU, NCCL on a GPU).

Each feature reaches DeepSpeed as its configuration says it, not through the harness's own loop:

- the step: ``engine.backward(loss)`` on each micro-batch's own mean loss, ``engine.step()`` after each (DeepSpeed
  steps at its accumulation boundary), the engine hooks of harness/adapters/base.py;
- ``accum``: ``gradient_accumulation_steps`` (DeepSpeed divides the loss by it and decides the boundary);
- ``clip``: ``gradient_clipping`` (an L2 norm: ``clip_inf`` is refused with DeepSpeed's reason);
- ``bf16``: its ``bf16`` section, with ``communication_data_type`` fp32 as the harness's policy asks the reduction;
- ``no_sync``: ``engine.no_sync()``, which DeepSpeed allows for stage 1 only;
- ``ckpt``: ``engine.save_checkpoint``, converted to DeepSpeed's universal checkpoint by its own converter
  (``ds_to_universal``) and loaded by ``engine.load_checkpoint`` with ``load_universal``, at any world size (the
  converter reads Adam's state only: refused with SGD);
- ``offload``: ZeRO-Offload, ``offload_optimizer`` to the host (and at stage 3 ``offload_param``), the harness's
  optimizer kept (``zero_force_ds_cpu_optimizer`` off: DeepSpeed would otherwise insist on its own CPU Adam);
- ``reshard2``: at stage 3 ZeRO++'s hierarchical partitioning (``zero_hpz_partition_size``): after forward each
  parameter stays as a secondary partition over groups of that many ranks, from which backward gathers it;
  refused at stages 1 and 2 (every parameter whole on every rank); ``shard1`` refused (flattened partitions);
- ``hsdp``: refused: ZeRO++ hierarchical partitioning (``zero_hpz_partition_size``) keeps a secondary copy of the
  parameters within each group, but partitions the gradients and optimizer state over every rank, which is not
  hybrid sharding's replicas (each holding a whole sharded copy).

The model is handed over whole: ``deepspeed.initialize`` partitions it itself (stage 3 with
``stage3_param_persistence_threshold`` 0, so that the zoo's small parameters are partitioned too rather than
kept whole on every rank). The engine needs its optimizer at initialisation, so ``wrap`` returns a module that the
engine fills in at ``make_optimizer``. The full parameters are DeepSpeed's fp32 master weights
(``safe_get_full_fp32_param``, collective), under bf16 too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from harness.adapters.base import PLAIN_WRAP, Adapter, AdapterError, WrapOptions, cpu_fp32

INSTALL = 'pip install -e ".[deepspeed]"'
TAG = "harness"  # the checkpoint's tag (a folder under the path the harness gives)


def _deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise AdapterError(
            f"adapter 'deepspeed_zero*' needs DeepSpeed ({INSTALL}): {type(exc).__name__}: {exc}"
        ) from None
    # its progress lines, its notes on the configuration the harness chose (an optimizer of torch's own) and torch's
    # deprecation notes for the collectives it calls: lines on every rank, every scenario
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return deepspeed


class DeepSpeedModule(nn.Module):
    """The plain model, to be driven by the DeepSpeed engine that `make_optimizer` makes (the engine holds it)."""

    def __init__(self, module: nn.Module, config: dict) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.__dict__["engine"] = None  # not a submodule: the engine holds `module` itself
        self.__dict__["no_sync"] = None  # the engine's no_sync context while the reduction is off

    def forward(self, *args, **kwargs):
        if self.engine is None:
            raise RuntimeError("DeepSpeed's engine is made with the optimizer (the adapter's make_optimizer)")
        if self.config.get("bf16", {}).get("enabled"):  # DeepSpeed's bf16 model takes bf16 inputs: the loop casts
            args, kwargs = tree_map(_to_bf16, (args, kwargs))
        return self.engine(*args, **kwargs)


def _to_bf16(x):
    return x.to(torch.bfloat16) if isinstance(x, Tensor) and x.is_floating_point() else x


class DeepSpeedAdapter(Adapter):
    wrap_settings = frozenset({"mixed_precision", "accumulation", "clipping", "offload", "reshard_after_forward"})

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.name = f"deepspeed_zero{stage}"
        self.sharded = True
        # what each stage partitions over the ranks (the rest every rank holds whole): its own ideal
        self.sharded_state = ("optimizer_state", "grads", "params")[:stage][::-1] if stage else ()

    # Initialization #

    def wrap(self, model: nn.Module, units, *, group, device, options: WrapOptions = PLAIN_WRAP) -> nn.Module:
        deepspeed = _deepspeed()
        import torch.distributed as dist

        # the engine reads the rank's device from LOCAL_RANK, which its own launcher and torchrun set
        dev = torch.device(device)
        os.environ.setdefault("LOCAL_RANK", str(dev.index if dev.type == "cuda" else dist.get_rank(group)))
        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend(group))
        # DeepSpeed allocates its reduce bucket whole on every rank (5e8 elements by default: 2 GB in fp32, whatever
        # the model's size); sized to the model, a bucket holds all of it, as the default does for any model below
        # that size, so the reductions are the same and only the memory differs
        size = sum(q.numel() for q in model.parameters())
        size += size % 2  # stages 1 and 2 assert an even allgather_bucket_size (nccl_start_alignment_factor 2)
        zero = {"stage": self.stage, "reduce_bucket_size": size, "allgather_bucket_size": size}
        if self.stage == 3:
            # memory_efficient_linear (on by default) replaces torch.nn.functional.linear for the whole process
            # and never restores it: the worker's later scenarios, the plain model's included, would run DeepSpeed's
            zero |= {
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": size,
                "memory_efficient_linear": False,
            }
        if options.offload:  # ZeRO-Offload: the optimizer's partitions (and at stage 3 the parameters') in host memory
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        if options.reshard_after_forward is not True and self.stage == 3:
            # ZeRO++'s hierarchical partitioning: after forward each parameter is kept as a secondary partition over
            # groups of this many ranks, from which backward gathers it: an integer reshard_after_forward
            zero["zero_hpz_partition_size"] = int(options.reshard_after_forward)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # batches come from the harness: a size for its bookkeeping only
            "gradient_accumulation_steps": options.micro_batches,
            "zero_optimization": zero,
            "steps_per_print": 1 << 30,
            "zero_allow_untested_optimizer": True,  # the harness's optimizers: torch's own SGD, or a user's
            "zero_force_ds_cpu_optimizer": False,  # offload keeps the harness's optimizer, not DeepSpeedCPUAdam
            "wall_clock_breakdown": False,
            # always said: DeepSpeed 0.19.8 clips at an L2 norm of 1.0 when the key is absent
            # (GRADIENT_CLIPPING_DEFAULT in deepspeed/runtime/constants.py); 0 turns its clipping off
            "gradient_clipping": options.clip[1] if options.clip is not None else 0.0,
        }
        if options.param_dtype is not None:
            config["bf16"] = {"enabled": True}
            config["communication_data_type"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
                options.reduce_dtype, "fp32"
            )
        return DeepSpeedModule(model.to(device), config)

    def make_optimizer(self, wrapped: DeepSpeedModule, *, name: str, lr: float):
        from harness.optimizers import make_optimizer

        deepspeed = _deepspeed()
        base = make_optimizer(wrapped.module.parameters(), name, lr)
        engine, optimizer, _, _ = deepspeed.initialize(model=wrapped.module, optimizer=base, config=wrapped.config)
        wrapped.__dict__["engine"] = engine
        return optimizer

    def refuses(self, feature: str, optimizer: str | None = None) -> str | None:
        from harness.core.features import has

        if has(feature, "ckpt") and optimizer == "sgd":
            return (
                "DeepSpeed's universal checkpoint converter (ds_to_universal) reads Adam's state (exp_avg, exp_avg_sq) "
                "only, and a ZeRO checkpoint loads at another world size only through it"
            )
        if has(feature, "clip_inf"):
            return "DeepSpeed's gradient_clipping clips by the L2 norm only"
        if has(feature, "no_sync") and self.stage > 1:
            return "DeepSpeed's no_sync is incompatible with the gradient partitioning of ZeRO stages 2 and 3"
        if has(feature, "reshard2") and self.stage < 3:
            return "ZeRO stages 1 and 2 keep every parameter whole on every rank: nothing is resharded after forward"
        if has(feature, "shard1"):
            return "DeepSpeed partitions each parameter's flattened elements, never along a dimension of the caller's"
        if has(feature, "hsdp"):
            return (
                "ZeRO++ hierarchical partitioning (zero_hpz_partition_size) keeps a secondary copy of the parameters "
                "within each group but partitions the gradients and optimizer state over every rank: not hybrid "
                "sharding's replicas"
            )
        return None

    # Runtime #

    def backward(self, wrapped: DeepSpeedModule, loss: Tensor) -> None:
        wrapped.engine.backward(loss)

    def step(self, wrapped: DeepSpeedModule, optimizer) -> None:
        wrapped.engine.step()

    def zero_grad(self, wrapped: DeepSpeedModule, optimizer) -> None:
        return None  # the engine zeroes its gradients at the accumulation boundary itself

    def set_gradient_sync(self, wrapped: DeepSpeedModule, enabled: bool) -> None:
        if not enabled and wrapped.no_sync is None:
            wrapped.__dict__["no_sync"] = wrapped.engine.no_sync()
            wrapped.no_sync.__enter__()
        elif enabled and wrapped.no_sync is not None:
            context, wrapped.__dict__["no_sync"] = wrapped.no_sync, None
            context.__exit__(None, None, None)

    def full_params(self, wrapped: DeepSpeedModule) -> dict[str, Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in wrapped.module.named_parameters():
            full = safe_get_full_fp32_param(p)
            out[name] = cpu_fp32(full if full is not None else p)
        return out

    def optimizer_state(self, wrapped: DeepSpeedModule, optimizer) -> dict[str, dict]:
        """Each model parameter's optimizer state, whole, read from the engine's partitioned buffers by DeepSpeed's
        own accessor (safe_get_full_optimizer_state: collective); the optimizer's per-group scalars (AdamW's step)
        as they are. Its own parameters are flat partitions, which no model parameter's name points at."""
        from deepspeed.utils import safe_get_full_optimizer_state

        base = getattr(optimizer, "optimizer", optimizer)  # the engine's ZeRO optimizer wraps torch's
        keys, scalars = set(), {}
        for held in base.state.values():
            for key, value in held.items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    keys.add(key)
                else:
                    scalars[key] = value
        out = {}
        for name, p in wrapped.module.named_parameters():
            state = {}
            for key in sorted(keys):
                full = safe_get_full_optimizer_state(p, key)
                if full is not None:
                    state[key] = cpu_fp32(full)
            state.update(scalars)
            out[name] = state
        return out

    def save_checkpoint(self, wrapped: DeepSpeedModule, optimizer, path) -> None:
        wrapped.engine.save_checkpoint(str(path), tag=TAG)

    def load_checkpoint(self, wrapped: DeepSpeedModule, optimizer, path) -> None:
        """DeepSpeed's universal checkpoint, which loads at any world size: rank 0 converts the saved one with
        DeepSpeed's own converter (deepspeed.checkpoint.ds_to_universal) once, then every rank loads it."""
        import torch.distributed as dist
        from deepspeed.checkpoint.ds_to_universal import main as to_universal

        universal = Path(path) / f"{TAG}_universal"
        if dist.get_rank() == 0 and not universal.exists():
            with contextlib.redirect_stdout(io.StringIO()):  # its progress, on every conversion
                to_universal(
                    SimpleNamespace(
                        input_folder=str(Path(path) / TAG),
                        output_folder=str(universal),
                        num_extract_workers=1,
                        num_merge_workers=1,
                        keep_temp_folder=False,
                        strict=True,
                        inject_missing_state=True,  # the state a Megatron client adds; a plain model has none
                    )
                )
        dist.barrier()
        engine = wrapped.engine
        engine._config.load_universal_checkpoint = True
        try:
            engine.load_checkpoint(str(path), tag=universal.name)
        finally:
            engine._config.load_universal_checkpoint = False
