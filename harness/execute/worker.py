"""Code that runs inside one rank: process setup, a world worker's task loop, the torchrun entry.

The parent side (starting, timing out, killing) lives in ``harness.execute.world``. Messages on a
rank's pipe, parent -> worker: ``("run", fn, payload)`` | ``("close",)``; worker -> parent:
``("ready", pid)`` | ``("ok", value)`` | ``("error", formatted_traceback)`` | ``("fatal", exception)``
(an exception whose class sets ``ends_the_run``: the parent raises it, the run ends).
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

LIFELINE_THREAD = " in lifeline_watch"  # how the watch thread's frame reads in a faulthandler dump


@dataclass
class RankContext:
    """What a task function receives inside a worker."""

    rank: int
    world_size: int
    group: dist.ProcessGroup
    device: torch.device
    backend: str
    # this rank's (shard group, replicate group) of the hybrid mesh (feature hsdp), where the pool
    # made them; None: harness.train.features.hybrid_groups makes them from the world's group
    hybrid: tuple | None = None


def setup_process() -> None:
    """Determinism and one intra-op thread; call before any tensor work."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def device_for(backend: str, local_rank: int, world_size: int) -> torch.device:
    """cuda:local_rank for nccl (one clear error if there are too few GPUs), else cpu."""
    if backend != "nccl":
        return torch.device("cpu")
    found = torch.cuda.device_count()
    if found < world_size:
        raise RuntimeError(f"backend 'nccl' needs {world_size} CUDA devices, found {found}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def resolve(fn: str) -> Callable[[RankContext, Any], Any]:
    """``"package.module:function"`` (the function may be a dotted attribute) -> the callable."""
    module_name, _, attr = fn.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def main(
    rank: int, world_size: int, backend: str, store_path: str, conn: Connection, lifeline: Connection, stack_path: str
) -> None:
    """Entry point of a world's worker process: join the group, then serve tasks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
    _die_with_parent(lifeline)
    stack_file = open(stack_path, "w")  # faulthandler keeps writing to it; stays open for life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable()  # fatal signals (segfaults) print their stack to stderr
    try:
        setup_process()
        device = device_for(backend, rank, world_size)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        ctx = RankContext(rank, world_size, dist.group.WORLD, device, backend)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        _serve(ctx, conn)
    finally:
        dist.destroy_process_group()


class _TorchFunctions:
    """torch.nn.functional's functions as the worker found them. An implementation may replace one for the whole
    process and leave it so (DeepSpeed's ZeRO-3 swaps in its own linear, memory_efficient_linear): the worker's next
    scenario, another implementation's or the plain model's, would compute with it (the hooks of a ZeRO-2 run that
    followed a ZeRO-3 one fired in another order, and its numbers moved by an ulp). Put back after every task."""

    def __init__(self) -> None:
        self.saved = {k: v for k, v in vars(torch.nn.functional).items() if not k.startswith("__")}

    def restore(self) -> list[str]:
        now = vars(torch.nn.functional)
        changed = [k for k, v in self.saved.items() if now.get(k) is not v]
        for k in changed:
            setattr(torch.nn.functional, k, self.saved[k])
        return changed


def _serve(ctx: RankContext, conn: Connection) -> None:
    functions = _TorchFunctions()
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent closed our pipe or died
            return
        if message[0] == "close":
            return
        _, fn, payload = message
        try:
            reply = ("ok", resolve(fn)(ctx, payload))
            conn.send(reply)  # pickles first: an unpicklable value raises before anything is written
        except BaseException as exc:
            # an error that is no scenario's (harness.core.scratch.ScratchError) goes back as itself
            ends_run = getattr(exc, "ends_the_run", False)
            conn.send(("fatal", exc) if ends_run else ("error", traceback.format_exc()))
        finally:
            functions.restore()


def _die_with_parent(lifeline: Connection) -> None:
    """Exit when the parent goes away, even while blocked in a collective.

    The parent holds the only write end of ``lifeline`` and never writes, so a read returns only
    at EOF: when the parent closes it (kill) or dies. PR_SET_PDEATHSIG adds a kernel-level guard
    where our parent is the launching process (spawn); under forkserver the parent is the server.
    """

    def lifeline_watch() -> None:  # named so that stack dumps can leave this thread out
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(3)

    threading.Thread(target=lifeline_watch, daemon=True).start()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


_PEER_FAILED = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def root_cause(failed: dict[int, str]) -> int:
    """The rank whose own error started it, not one that only lost its peer or timed out on it."""
    own = [r for r, tb in failed.items() if not any(s in tb.strip().splitlines()[-1] for s in _PEER_FAILED)]
    return min(own or failed)
