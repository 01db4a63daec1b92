"""Process worlds: W worker processes started once, joined in one process group, reused for many tasks.

A ``World`` runs ``"package.module:function"`` on every rank and returns the values in rank
order. Rendezvous goes through a ``FileStore`` in a fresh temp dir (never a fixed port, so
pytest-xdist workers never collide). A raising rank gives ``RankFailed``; a rank that does not
answer in time gives ``WorldHung`` with the Python stack of each stuck rank. Either way the world
is killed: no worker outlives a failure, a ``close()``, Ctrl-C, ``atexit`` or the parent's death.

The process that builds a world or a pool (the parent, never a worker) unwinds on SIGTERM and
SIGHUP as on Ctrl-C: they raise KeyboardInterrupt in its main thread, so worlds are killed and
temp dirs removed on the way out (see ``unwind_on_termination``). Ctrl-C while a world or the
forkserver is still starting unwinds the same way, with no traceback from a child (see
[Note: Ctrl-C while a world starts]).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.process
import multiprocessing.util
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from harness.core import interrupt
from harness.core.children import main_hidden
from harness.execute import forked_server, worker
from harness.execute.launch import launched_by_torchrun
from harness.execute.worker import RankContext

__all__ = ["World", "WorldPool", "RankContext", "WorldError", "RankFailed", "WorldHung", "launched_by_torchrun"]

_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # before torch loads in a worker
# imported once, in the forkserver; torch._inductor.config is what use_deterministic_algorithms
# imports (seconds per worker otherwise), and it pulls in torch.distributed.fsdp / .tensor too; its
# torch._dynamo every rank needs anyway, at its first optimizer (reports/performance.md#world-start).
_PRELOAD = ["torch", "torch.distributed", "torch._inductor.config", worker.__name__]


def preload(*modules: str) -> None:
    """Have the forkserver import `modules` too, once, before it forks any worker (each fresh world's
    workers would import them again otherwise). No effect once the forkserver runs."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


_FAILURE_GRACE_S = 1.0  # after a first failure, time left for the other ranks to report theirs
_STACK_WAIT_S = 3.0  # how long a stuck rank gets to write its stack
_CLOSE_WAIT_S = 5.0  # how long a clean close waits before killing
# Python runs a signal's handler in the main thread, once that thread is back in bytecode; a signal the kernel
# delivers to another thread (the program's own, pytest-xdist's, a lane's) does not interrupt the main thread's
# poll. So the main thread waits for ranks (and the executor for its lanes) at most this long at a time, and a Ctrl-C
# is never held longer.
SIGNAL_SLICE_S = 0.25
_LIVE: weakref.WeakSet[World] = weakref.WeakSet()  # closed at interpreter exit
_UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # `kill PID`, a closed terminal


def unwind_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does.

    Only for a signal that still has its default action (a handler the program installed is
    kept, and a signal ignored at start, as `nohup` and a script's background job leave SIGHUP
    and SIGINT, stays ignored: that is what the user's shell asked for) and only from the main
    thread (where Python runs handlers). The first such signal
    restores the default action of both: a second one ends the process at once.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _UNWIND_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _interrupt)


def _interrupt(signum: int, _frame: object) -> None:
    interrupt.note()
    for sig in _UNWIND_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    raise KeyboardInterrupt(signal.Signals(signum).name)


class WorldError(RuntimeError):
    """The world cannot run a task (start failed, broken, closed)."""


class RankFailed(WorldError):
    """A rank raised (or died); ``tracebacks`` maps each failed rank to its formatted traceback."""

    def __init__(self, message: str, tracebacks: dict[int, str]):
        super().__init__(message)
        self.tracebacks = tracebacks


class WorldHung(WorldError):
    """Ranks did not answer in time; ``stacks`` maps each missing rank to where it was waiting."""

    def __init__(self, message: str, answered: list[int], missing: list[int], stacks: dict[int, str]):
        super().__init__(message)
        self.answered, self.missing, self.stacks = answered, missing, stacks


class World:
    """``world_size`` worker processes in one process group; ``run`` calls a task on every rank."""

    def __init__(
        self, world_size: int, backend: str = "gloo", *, timeout_s: float = 300.0, start_method: str = "forkserver"
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise WorldError(f"backend 'nccl' needs {world_size} CUDA devices, found {torch.cuda.device_count()}")
        unwind_on_termination()
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self.start_method = start_method
        self._broken = self._closed = False
        self._tmp = tempfile.mkdtemp(prefix=f"world{world_size}-")
        self._stack_paths = [os.path.join(self._tmp, f"stack-rank{r}.txt") for r in range(world_size)]
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        _LIVE.add(self)
        try:
            self._start()
            self.pids: list[int] = [proc.pid for proc in self._procs]
            self._collect("start", time.monotonic() + timeout_s)
        except BaseException as exc:
            self._kill()
            if isinstance(exc, KeyboardInterrupt) and start_method == "forkserver":
                stop_forkserver()  # it may still be importing torch: it would outlive us by seconds
            raise

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, fn: str, payload: Any = None, timeout_s: float | None = None) -> list:
        """Call ``fn(ctx, payload)`` on every rank; return the values in rank order."""
        if self._closed:
            raise WorldError(f"{self!r} is {'broken' if self._broken else 'closed'}; build a new one")
        if ":" not in fn:
            raise ValueError(f"fn must be 'package.module:function', got {fn!r}")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        message = bytes(ForkingPickler.dumps(("run", fn, payload)))  # pickled once for all ranks
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(message)
                except OSError as exc:
                    raise RankFailed(f"rank {rank} of {self!r} is gone ({exc})", {rank: str(exc)}) from exc
            return self._collect(fn, deadline)
        except BaseException:  # RankFailed, WorldHung, Ctrl-C: no worker survives
            self._kill()
            raise

    def kill(self) -> None:
        """Kill every rank now (a caller that stops waiting for a task it gave the world: a Ctrl-C while another
        thread waits for it, harness.execute.executor). Idempotent."""
        self._kill()

    def close(self) -> None:
        """Ask every rank to destroy its group and exit; kill what has not exited in time."""
        if self._closed:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))
        deadline = time.monotonic() + _CLOSE_WAIT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill(broken=False)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"World({self.world_size}, {self.backend!r}, start_method={self.start_method!r})"

    # -- internals -------------------------------------------------------------------------

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        lifeline_r, self._lifeline = ctx.Pipe(duplex=False)  # we never write: EOF = we are gone
        store_path = os.path.join(self._tmp, "store")
        with _env(_WORKER_ENV), main_hidden():  # inherited by workers and a new forkserver
            if self.start_method == "forkserver":
                _start_forkserver()
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=worker.main,
                    name=f"world{self.world_size}-rank{rank}",
                    args=(
                        rank,
                        self.world_size,
                        self.backend,
                        store_path,
                        child_end,
                        lifeline_r,
                        self._stack_paths[rank],
                    ),
                )
                with _ctrl_c_after_hand_over():
                    proc.start()
                    child_end.close()
                    self._procs.append(proc)
                    self._conns.append(parent_end)
        lifeline_r.close()

    def _collect(self, fn: str, deadline: float) -> list:
        """Wait for one reply per rank; raise RankFailed / WorldHung (the caller kills the world)."""
        values: list[Any] = [None] * self.world_size
        failed: dict[int, str] = {}
        fatal: list[BaseException] = []  # errors that end the run, not the scenario (worker.py)
        pending = set(range(self.world_size))
        grace_end = float("inf")
        while pending and time.monotonic() < min(deadline, grace_end):
            handles = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            # in slices: a Ctrl-C the kernel gave another thread of this process does not end this poll
            slice_end = min(deadline, grace_end, time.monotonic() + SIGNAL_SLICE_S)
            for handle in wait(list(handles), slice_end - time.monotonic()):
                rank = handles[handle]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if handle is not conn and conn.poll():  # died after replying: read the reply first
                    continue
                try:
                    kind, value = conn.recv() if handle is conn else ("died", None)
                except (EOFError, OSError):
                    kind, value = "died", None
                pending.discard(rank)
                if kind == "died":
                    self._procs[rank].join(1.0)
                    failed[rank] = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                elif kind == "error":
                    failed[rank] = value
                elif kind == "fatal":
                    failed[rank] = str(value)
                    fatal.append(value)
                else:
                    values[rank] = value
            if failed and grace_end == float("inf"):
                grace_end = time.monotonic() + _FAILURE_GRACE_S
        if fatal:
            raise fatal[0]
        if failed:
            raise RankFailed(self._failure_message(fn, failed, pending), failed)
        if pending:
            raise self._hung(fn, sorted(set(range(self.world_size)) - pending), sorted(pending))
        return values

    def _failure_message(self, fn: str, failed: dict[int, str], pending: set[int]) -> str:
        first = worker.root_cause(failed)
        lines = [f"rank {first} of {self!r} failed in {fn}:", failed[first].rstrip()]
        for rank in sorted(set(failed) - {first}):
            lines.append(f"rank {rank} failed too: {failed[rank].strip().splitlines()[-1]}")
        if pending:
            lines.append(f"ranks {sorted(pending)} had not answered (killed)")
        return "\n".join(lines)

    def _hung(self, fn: str, answered: list[int], missing: list[int]) -> WorldHung:
        stacks = self._dump_stacks(missing)
        lines = [f"{self!r} hung in {fn}: ranks {answered} answered, ranks {missing} did not"]
        for rank in missing:
            lines += [f"--- rank {rank} (pid {self.pids[rank]}) was waiting here ---", stacks[rank]]
        return WorldHung("\n".join(lines), answered, missing, stacks)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Signal each rank's faulthandler (SIGUSR1) and read the stack it writes to its file. A rank
        that has not opened its file yet (a world still starting) has no stack to give."""
        offsets = {r: _size(self._stack_paths[r]) for r in ranks}
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[rank], signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline and not all(
            _size(self._stack_paths[r]) > offsets[r] for r in ranks if offsets[r] >= 0
        ):
            time.sleep(0.05)
        time.sleep(0.1)  # lets a dump that has started finish writing
        stacks = {}
        for rank in ranks:
            if offsets[rank] < 0:
                stacks[rank] = "(no stack: the rank had not started yet)"
                continue
            with open(self._stack_paths[rank]) as f:
                f.seek(offsets[rank])
                stacks[rank] = _drop_lifeline_thread(f.read()) or "(no stack: no answer to SIGUSR1)"
        return stacks

    def _kill(self, broken: bool = True) -> None:
        """Close the lifeline, SIGKILL and reap every worker, drop the temp dir. Idempotent."""
        if self._closed:
            return
        self._closed, self._broken = True, broken
        if hasattr(self, "_lifeline"):
            self._lifeline.close()  # workers blocked in a collective exit on EOF
        for proc in self._procs:
            if proc.exitcode is None:
                with contextlib.suppress(Exception):
                    proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        _LIVE.discard(self)


class WorldPool:
    """Reuses a world for consecutive requests of the same (world_size, backend, lane); a broken world is rebuilt
    transparently on the next ``get``. ``reuse=False`` starts a fresh world for every ``get`` (the
    baseline the benchmark measures). By default only the worlds of one (world_size, backend) live: a request of
    another closes them; several of one size, one per ``lane``, run scenarios side by side
    (harness.execute.executor). ``keep=True`` keeps every world until ``close``, for an owner that
    comes back to sizes it used (a test session whose files each run W = 1, 2, 4, 8 in turn): a world's
    start and its workers' first-use costs are paid once, for W idle processes per size kept (CPU
    backends only: a kept CUDA world would hold its device's memory while another world measures)."""

    def __init__(
        self, *, timeout_s: float = 300.0, start_method: str = "forkserver", reuse: bool = True, keep: bool = False
    ):
        unwind_on_termination()  # before the owner makes temp dirs for the pool's worlds to write in
        self.timeout_s, self.start_method, self.reuse, self.keep = timeout_s, start_method, reuse, keep
        self.worlds_started = 0
        self.start_s_by_size: dict[int, float] = {}  # world size -> seconds spent starting its worlds
        self._worlds: dict[tuple[int, str, int], World] = {}

    def get(self, world_size: int, backend: str = "gloo", lane: int = 0) -> World:
        key = (world_size, backend, lane)
        world = self._worlds.get(key)
        if self.reuse and world is not None and not world.closed:
            return world
        if world is not None:
            self._worlds.pop(key).close()
        if self.keep and backend != "nccl":
            others = [k for k in self._worlds if k[1] == "nccl"]
        else:
            others = [k for k in self._worlds if k[:2] != key[:2] or not self.reuse]
        for other in others:
            self._worlds.pop(other).close()
        t0 = time.perf_counter()
        world = self._worlds[key] = World(world_size, backend, timeout_s=self.timeout_s, start_method=self.start_method)
        self.start_s_by_size[world_size] = self.start_s_by_size.get(world_size, 0.0) + time.perf_counter() - t0
        self.worlds_started += 1
        return world

    @property
    def start_s(self) -> float:
        """Seconds spent starting worlds (the first one's includes the forkserver's, where it started it)."""
        return sum(self.start_s_by_size.values())

    def close(self) -> None:
        while self._worlds:
            self._worlds.popitem()[1].close()

    def __enter__(self) -> WorldPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# [Note: Ctrl-C while a world starts] A Ctrl-C reaches every process of the foreground group: the
# parent, the forkserver and the workers. The forkserver ignores SIGINT only once it has imported its
# preload (torch: seconds), and a worker it forks gets the forkserver's original handler back until
# worker.main ignores SIGINT; a Ctrl-C in either window printed a KeyboardInterrupt traceback from
# that child. So the forkserver starts with SIGINT blocked (``_start_forkserver``): the mask is
# inherited across fork and exec, so neither it nor a worker ever takes a SIGINT before ignoring it
# (setting SIG_IGN drops a pending one). The parent alone turns a Ctrl-C into KeyboardInterrupt: it
# kills the world, and a forkserver that may still be importing (``stop_forkserver``). Within
# ``Process.start`` the parent hands a worker its task over a pipe; interrupted before it has written
# it, it would leave the new worker to fail on a short read, with a traceback. So a Ctrl-C there is
# held until the worker is recorded (``_ctrl_c_after_hand_over``), except where the parent waits for
# the forkserver's reply, which comes after the task is written and may take the forkserver's whole
# start-up: there it raises at once.


def start_forkserver() -> None:
    """Start the worlds' forkserver now, if it is not running, so that it imports its preload (torch's compiler
    config, which torch.use_deterministic_algorithms and the memory tracker import, and the training task: seconds)
    while this process goes on (the CLI checks its options meanwhile); the first world then starts without waiting
    for those imports. `stop_forkserver` if no world is started after all. A world starts the server itself where
    nothing did."""
    with _env(_WORKER_ENV), main_hidden():  # inherited by the server and the workers it forks
        _start_forkserver()


def _start_forkserver() -> None:
    """Start multiprocessing's forkserver, if it is not running, with SIGINT blocked in it (see
    [Note: Ctrl-C while a world starts]); a Ctrl-C meanwhile reaches this thread once unblocked.
    Forked from this process where that is safe (harness/execute/forked_server.py), else executed.
    The resource tracker first: starting it unblocks SIGINT on its way out. Call it inside
    `_env(_WORKER_ENV)` and `main_hidden()`: a new server inherits both."""
    from multiprocessing import forkserver, resource_tracker

    _socket_dir_that_fits()
    # no effect once the server runs; the last one freezes what the others made (preloaded.py)
    mp.get_context("forkserver").set_forkserver_preload([*_PRELOAD, "harness.execute.preloaded"])
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        server = forkserver._forkserver  # multiprocessing's own instance, whose preload set_forkserver_preload set
        if not forked_server.start(server, server._preload_modules):
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stop_forkserver() -> None:
    """Kill the forkserver this process started, if it runs (the next world starts another): one still importing
    its preload would outlive this process by seconds."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # multiprocessing's own instance; _stop closes, reaps, unlinks
    if server._forkserver_pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(server._forkserver_pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()


def _forkserver_reply_code():
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "read_signed", None), "__code__", None)


@contextlib.contextmanager
def _ctrl_c_after_hand_over() -> Iterator[None]:
    """Hold a Ctrl-C until the block ends, except in the wait for the forkserver's reply (see
    [Note: Ctrl-C while a world starts]). Only where Ctrl-C raises KeyboardInterrupt in this thread:
    an ignored SIGINT, or a handler of the program's own, is left alone."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not interrupt.raises_keyboard_interrupt(previous):
        yield
        return
    held: list[int] = []
    waiting_for_reply = _forkserver_reply_code()

    def hold(signum: int, frame) -> None:
        interrupt.note()
        if frame is not None and frame.f_code is waiting_for_reply:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt  # a Ctrl-C outranks whatever else ended the block


# [Note: forkserver socket path] The forkserver listens on an AF_UNIX socket at
# <multiprocessing temp dir>/listener-XXXXXXXX, and that temp dir is <TMPDIR>/pymp-XXXXXXXX. Linux
# holds a socket path in 108 bytes with its NUL, so a TMPDIR longer than about 74 characters
# (pytest's tmp_path for a long test name is one) makes the server's bind() fail with "AF_UNIX path
# too long". Python 3.14 falls back to a short system temp dir in that case; on older Pythons the
# harness does the same before the first forkserver starts.
_SOCKET_PATH_MAX = 107
_PYMP_DIR = len("/pymp-XXXXXXXX")  # the folder multiprocessing makes under TMPDIR
_LISTENER = len("/listener-XXXXXXXX")  # the socket in it
_SHORT_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")


def _socket_dir_that_fits() -> None:
    """Make multiprocessing's temp dir one whose socket paths fit (see [Note: forkserver socket path])."""
    config = mp.process.current_process()._config  # where multiprocessing.util.get_temp_dir caches it
    current = config.get("tempdir")
    folder_len = len(current) if current is not None else len(tempfile.gettempdir()) + _PYMP_DIR
    if folder_len + _LISTENER <= _SOCKET_PATH_MAX:
        return
    for base in _SHORT_TEMP_DIRS:
        if os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            short = tempfile.mkdtemp(prefix="pymp-", dir=base)
            break
    else:
        raise WorldError(
            f"the temp dir {tempfile.gettempdir()!r} is too long for the forkserver's socket "
            f"(AF_UNIX paths hold {_SOCKET_PATH_MAX} bytes) and none of {', '.join(_SHORT_TEMP_DIRS)} "
            "is writable: set TMPDIR to a shorter path"
        )
    config["tempdir"] = short  # a long one made earlier stays: multiprocessing removes it at exit
    # removed at exit, as multiprocessing removes the temp dir it makes itself
    mp.util.Finalize(None, shutil.rmtree, args=(short,), kwargs={"ignore_errors": True}, exitpriority=-100)


def _size(path: str) -> int:
    """A stack file's size; -1 where the rank has not made it yet."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return -1


def _drop_lifeline_thread(dump: str) -> str:
    """A faulthandler dump without the worker's lifeline-watch thread (it only waits on a pipe)."""
    blocks = dump.strip().split("\n\n")
    return "\n\n".join(b for b in blocks if worker.LIFELINE_THREAD not in b)


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@atexit.register
def _close_live_worlds() -> None:
    for world in list(_LIVE):
        world.close()


def call_or_error(pool: WorldPool, world_size: int, task: str, payload) -> tuple[list | None, str]:
    """`task` run on `pool`'s world of `world_size` ranks: (per-rank results, '') or (None, one line: the
    exception and the last line of the first failing rank's traceback); a failed world is rebuilt on next get."""
    try:
        return pool.get(world_size).call(task, payload), ""
    except WorldError as exc:
        tracebacks = getattr(exc, "tracebacks", {})
        text = tracebacks[min(tracebacks)] if tracebacks else str(exc)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception):", ln)]
        if not tracebacks:  # the world's own word (hung, broken): its first line says what happened
            errors = lines[:1]
        picked = list(dict.fromkeys(errors[-1:] + lines[-1:]))  # the exception, then the last line
        return None, f"{type(exc).__name__}: {' | '.join(picked) or exc}"[:500]
