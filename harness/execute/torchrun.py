"""The scenario matrix inside a job that torchrun already launched (``torchrun ... -m harness run``).

``torchrun_job`` sets up a ``TorchrunPool``: the pool that puts a scenario on processes torchrun (or SLURM
through torchrun) started, where ``ReusedWorlds`` puts it on worlds the harness starts. Every process of the
job enters it with the same scenarios. The default group joins through env://; a scenario of world size w runs
``harness.train.task:train_scenario`` on ranks 0..w-1 in a subgroup made for w (ranks w.. wait), and rank 0
collects the records and builds the tables and verdicts (``harness.phases.run_matrix_under_torchrun``).

Control goes through the job's key-value store, not through collectives, so a broken or hung
scenario never leaves the control path in a bad state:

- each rank of the scenario posts ``("ok", record)`` or ``("error", traceback)`` under
  ``<run>/<i>/out/<rank>``. A rank that raises also destroys its subgroup; peers blocked in a
  collective with it fail at once if that closes the connections, else at the subgroup timeout,
  and report that too (the report leads with the rank whose own error started it);
- subgroups are created with ``timeout=timeout_s``: a rank stuck in a collective that the others
  skipped raises after that time; a watchdog thread on each rank posts the rank's Python stack
  under ``<run>/<i>/stack/<rank>`` shortly before ``timeout_s`` (``STACK_AT``) if the scenario still
  runs, while a stuck collective still waits, so the failure says which ranks were waiting where;
- rank 0 waits for the outcomes until ``timeout_s`` plus a grace (at most ``GRACE_S``) and
  posts a decision: go on, rebuild (a rank failed: the subgroup for w is destroyed and made
  again, as a World would be rebuilt), or abort (a rank never answered: it may be stuck for good; the remaining scenarios are
  reported "not run"). The other ranks wait for that decision.

Snapshots: ``train_scenario`` gathers the full parameters collectively (``adapter.full_params``) and
only rank 0 writes them, into a temp dir on rank 0's node; rank 0 is also where the tables are
built. So multi-node runs need no shared filesystem.

Processes: torchrun owns them. A rank stuck outside any collective (a Python infinite loop) cannot
be interrupted from inside; its watchdog ends the process (exit code 3) once rank 0 has finished
(it posts ``<run>/finished`` at exit) or ``HARD_EXIT_AFTER_S`` after the timeout, whichever comes
first, and torchrun then reports that rank as failed. Launch with ``--standalone`` (or a
rendezvous endpoint of your choice) so that no fixed port is used.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from harness.core.features import has
from harness.core.scenario import Scenario
from harness.execute.executor import execute
from harness.execute.launch import (
    TORCHRUN_VARIABLES,
    NotLaunchedHere,
    TorchrunUsageError,
    check_job_fits,
    launched_by_torchrun,
    peer_wait_s,
)
from harness.execute.worker import RankContext, device_for, root_cause, setup_process

__all__ = ["torchrun_job", "Job", "TorchrunPool", "TorchrunError", "TorchrunUsageError"]

GRACE_S = 10.0  # at most, after the timeout: time for a rank whose collective timed out to report it
HARD_EXIT_AFTER_S = 300.0  # a rank stuck past timeout + this exits even if rank 0 never finished
_POLL_S = 0.05
# the fraction of the timeout at which a rank's watchdog posts its stack: before the subgroup's collective timeout
# (the same timeout) ends the wait the stack must show. Posted at the timeout itself, the two raced, and on a
# loaded machine the stack showed the timed-out collective's error path instead of where the rank waited
STACK_AT = 0.8
_runs = 0  # calls in this process; every rank makes the same calls, so keys agree across ranks


class TorchrunError(RuntimeError):
    """The torchrun job cannot run the matrix (not launched by torchrun, rank 0 went silent)."""


@dataclass
class Job:
    """Rank 0's view of the torchrun job a matrix runs in: the pool that puts scenarios on the job's ranks, and
    the temp dir on rank 0's node where the snapshots go."""

    pool: TorchrunPool
    snapshot_dir: str


@contextlib.contextmanager
def torchrun_job(scenarios: list[Scenario], *, timeout_s: float = 300.0) -> Iterator[Job | None]:
    """The job torchrun launched, set up to run `scenarios`: every process of the job enters it with the same
    scenarios. Rank 0 gets a `Job` and runs the matrix on its pool (harness.phases.run_matrix); every other
    rank runs its part of each scenario inside this call and gets None."""
    global _runs
    if not launched_by_torchrun():
        raise TorchrunError(f"not launched by torchrun: {' / '.join(TORCHRUN_VARIABLES)} are not all set")
    rank, job_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = _check_fits(scenarios, job_size)
    if not dist.is_initialized():
        check_launched_here()
    setup_process()
    device = device_for(
        backend, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", job_size))
    )
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s + GRACE_S + 60))
    _runs += 1
    store = dist.PrefixStore(f"fsdp-harness/run{_runs}/", dist.distributed_c10d._get_default_store())
    if rank == 0:
        atexit.register(store.set, "finished", b"1")  # lets a stuck rank's watchdog end its process
    _preload(scenarios)
    pool = TorchrunPool(store, rank, backend, device, timeout_s)
    try:
        if rank == 0:
            with tempfile.TemporaryDirectory(prefix="fsdp-harness-") as tmp:
                store.set("snapshot_dir", tmp.encode())
                yield Job(pool, tmp)
            return
        store.wait(["snapshot_dir"], timedelta(seconds=timeout_s + GRACE_S + 60))
        execute(scenarios, snapshot_dir=store.get("snapshot_dir").decode(), pool=pool)
        yield None
    finally:
        pool.destroy_groups()
        if owns_group:
            dist.destroy_process_group()


def check_launched_here() -> None:
    """torchrun's variables may be left over from another job (exported in a shell, inherited by a
    process): then no agent and no peers exist, and joining the group would wait the whole group
    timeout in C++, deaf to Ctrl-C. torchrun's agent sets TORCHELASTIC_USE_AGENT_STORE with the rest;
    where it hosts the store ("True") the store listens before any worker starts, and where rank 0
    hosts it ("False") rank 0 opens it on joining the group. So: the variable must be there, and the
    store must answer at MASTER_ADDR:MASTER_PORT (rank 0 of a job without the agent's store opens it
    itself) within `peer_wait_s()`. Polled in Python: Ctrl-C ends the wait. NotLaunchedHere else."""
    rank, agent_store = int(os.environ["RANK"]), os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    names = f"TORCHELASTIC_RUN_ID={os.environ.get('TORCHELASTIC_RUN_ID')} and RANK={rank}"
    advice = (
        "left over from another job? unset TORCHELASTIC_RUN_ID RANK WORLD_SIZE MASTER_ADDR MASTER_PORT for a "
        "plain run, or launch with torchrun"
    )
    if agent_store is None or "MASTER_PORT" not in os.environ:
        missing = "TORCHELASTIC_USE_AGENT_STORE" if agent_store is None else "MASTER_PORT"
        raise NotLaunchedHere(
            f"{names} are set, but {missing}, which torchrun's agent sets with them, is not: {advice}"
        )
    if rank == 0 and agent_store != "True":
        return
    where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    wait_s = peer_wait_s()
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            socket.create_connection(where, timeout=1.0).close()
            return
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        if not said:
            sys.stderr.write(
                f"waiting up to {wait_s:.0f} s for torchrun's store at {where[0]}:{where[1]} ({names}; Ctrl-C stops)\n"
            )
            sys.stderr.flush()
            said = True
        if time.monotonic() >= deadline:
            raise NotLaunchedHere(
                f"{names} are set, but nothing answers at MASTER_ADDR:MASTER_PORT "
                f"({where[0]}:{where[1]}), where torchrun's store would be, after {wait_s:.0f} s "
                f"({reason}): {advice}"
            )
        time.sleep(0.2)


def _preload(scenarios: list[Scenario]) -> None:
    """Import the training code and every adapter's module now, on every rank, so that no rank's
    first scenario spends the subgroup timeout importing while a peer waits in a collective."""
    from harness.adapters import load_adapter
    from harness.train import task  # noqa: F401

    for impl in dict.fromkeys(s.impl for s in scenarios):
        load_adapter(impl)


def _check_fits(scenarios: list[Scenario], job_size: int) -> str:
    """The one backend of the matrix; TorchrunUsageError if a scenario needs more ranks than the job."""
    check_job_fits([s.world_size for s in scenarios], job_size)
    backends = sorted({s.backend for s in scenarios}) or ["gloo"]
    if len(backends) > 1:
        raise TorchrunUsageError(f"--backend: one torchrun job runs one backend, got {', '.join(backends)}")
    return backends[0]


class TorchrunPool:
    """`ScenarioPool` over the job's processes: this rank's side of each scenario; rank 0 also
    collects the outcomes, decides, and returns the records (the other ranks return None)."""

    def __init__(self, store, rank: int, backend: str, device, timeout_s: float):
        self.store, self.rank, self.backend, self.device = store, rank, backend, device
        self.timeout_s = timeout_s
        self.groups: dict[int, object] = {}
        self.hybrid: dict[int, tuple | None] = {}  # w -> this rank's hybrid groups (feature hsdp)
        self.worlds_started = 0  # subgroups built: a torchrun job's "worlds"
        self._scenarios_run = 0
        self.aborted = ""
        self._missing: list[int] = []  # rank 0: ranks that did not answer in the last scenario
        self._failed = False  # rank 0: a rank of the last scenario raised

    def group(self, w: int):
        """The subgroup of ranks 0..w-1 (every rank of the job calls this, in the same order)."""
        if w not in self.groups:
            self.groups[w] = dist.new_group(
                ranks=list(range(w)), backend=self.backend, timeout=timedelta(seconds=self.timeout_s)
            )
            self.worlds_started += 1
        return self.groups[w]

    def hybrid_groups(self, w: int) -> None:
        """The hybrid mesh's groups over ranks 0..w-1 (feature hsdp), made by every rank of the job in
        the same order, as the subgroups are; ranks below w keep theirs for the RankContext."""
        if w not in self.hybrid:
            from harness.train.features import make_hybrid_groups

            self.hybrid[w] = make_hybrid_groups(
                list(range(w)),
                self.rank,
                lambda members: dist.new_group(
                    ranks=members, backend=self.backend, timeout=timedelta(seconds=self.timeout_s)
                ),
            )

    def drop_group(self, w: int) -> None:
        """Destroy the subgroup for w. If nothing else holds it any more, its gloo connections
        close and peers blocked in a collective with this rank fail at once ("Connection closed by
        peer"); an implementation that keeps it alive (fsdp_impl's handles do, through autograd
        hooks of the failed step) leaves the peers to fail at the subgroup timeout instead."""
        self.hybrid.pop(w, None)  # made again, by every rank, when a scenario needs them
        group = self.groups.pop(w, None)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        try:
            dist.destroy_process_group(group)
        except Exception:  # already destroyed
            pass
        del group
        gc.collect()

    def destroy_groups(self) -> None:
        for w in list(self.groups):
            self.drop_group(w)

    def run_scenario(self, sc: Scenario, payload: dict) -> dict | None:
        i, self._scenarios_run = self._scenarios_run, self._scenarios_run + 1
        if self.aborted:
            return {"error": f"not run: {self.aborted}"} if self.rank == 0 else None
        w, key = sc.world_size, f"{i}/"
        started = time.monotonic()
        self.group(w)  # every rank, in the same order; no reference kept here (see drop_group)
        if has(sc.feature, "hsdp"):
            self.hybrid_groups(w)  # every rank of the job takes part in making them
        if self.rank < w:
            outcome = self._train(key, w, payload)
            self.store.set(f"{key}out/{self.rank}", pickle.dumps(outcome))
            if outcome[0] == "error":
                self.drop_group(w)  # peers blocked in a collective with this rank fail at once
        result = self._collect(key, sc, started) if self.rank == 0 else None
        decision = self._decision(key, sc)
        if decision != "go":
            self.drop_group(w)
        if decision == "abort":
            self.aborted = f"scenario {sc.id} hung under torchrun and its ranks cannot be recovered in-process"
        return result

    def _train(self, key: str, w: int, payload: dict) -> tuple:
        from harness.train.task import train_scenario

        done = threading.Event()
        main_thread = threading.main_thread().ident
        watchdog = threading.Thread(
            target=self._watch, args=(key, main_thread, done), name="fsdp-harness-watchdog", daemon=True
        )
        watchdog.start()
        try:
            ctx = RankContext(self.rank, w, self.group(w), self.device, self.backend, self.hybrid.get(w))
            # the snapshot folder is rank 0's: the other ranks write into it only where the job runs on one node
            one_node = int(os.environ.get("LOCAL_WORLD_SIZE", -1)) == int(os.environ["WORLD_SIZE"])
            return ("ok", train_scenario(ctx, {**payload, "ranks_share_dir": one_node}))
        except Exception:
            return ("error", traceback.format_exc())
        finally:
            done.set()

    def _watch(self, key: str, thread_id: int, done: threading.Event) -> None:
        """Shortly before the timeout, post where this rank is; much later, end a rank that never came back."""
        if done.wait(self.timeout_s * STACK_AT):
            return
        frame = sys._current_frames().get(thread_id)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no Python frame)"
        self.store.set(f"{key}stack/{self.rank}", stack.encode())
        hard_deadline = time.monotonic() + self.timeout_s * (1 - STACK_AT) + HARD_EXIT_AFTER_S
        while not done.wait(1.0):
            if self.store.check(["finished"]) or time.monotonic() > hard_deadline:
                sys.stderr.write(
                    f"[fsdp-harness] rank {self.rank} is still stuck in a scenario past its "
                    f"timeout; ending this process\n"
                )
                sys.stderr.flush()
                os._exit(3)

    def _collect(self, key: str, sc: Scenario, started: float) -> dict:
        """Rank 0: every rank's outcome, or a hang report with the stacks of the silent ranks."""
        w = sc.world_size
        keys = {r: f"{key}out/{r}" for r in range(w)}
        deadline = started + self.timeout_s + _grace(self.timeout_s)
        while time.monotonic() < deadline and not self.store.check(list(keys.values())):
            time.sleep(_POLL_S)
        outcomes = {r: pickle.loads(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}
        missing = sorted(set(range(w)) - set(outcomes))
        failed = {r: v for r, (kind, v) in outcomes.items() if kind == "error"}
        label = f"torchrun ranks 0..{w - 1} (job of {os.environ.get('WORLD_SIZE')})"
        if missing:
            lines = [f"{label} hung in {sc.id}: ranks {sorted(outcomes)} answered, ranks {missing} did not"]
            for r in missing:
                stack_key = f"{key}stack/{r}"
                stack = self.store.get(stack_key).decode() if self.store.check([stack_key]) else "(no stack)"
                lines += [f"--- rank {r} was waiting here ---", stack.rstrip()]
            for r in sorted(failed):
                lines += [f"--- rank {r} failed (it had waited for the silent ranks) ---", failed[r].rstrip()]
            self._missing, self._failed = missing, bool(failed)
            return {"error": "\n".join(lines), "failed_rank": missing[0]}
        self._missing, self._failed = [], bool(failed)
        if failed:
            first = root_cause(failed)
            lines = [f"rank {first} of {label} failed in {sc.id}:", failed[first].rstrip()]
            lines += [
                f"rank {r} failed too: {failed[r].strip().splitlines()[-1]}" for r in sorted(failed) if r != first
            ]
            return {"error": "\n".join(lines), "failed_rank": first}
        return {"ranks": [outcomes[r][1] for r in range(w)]}

    def _decision(self, key: str, sc: Scenario) -> str:
        """Rank 0 posts go | rebuild | abort; every other rank waits for it."""
        k = f"{key}decision"
        if self.rank == 0:
            decision = "abort" if self._missing else "rebuild" if self._failed else "go"
            self.store.set(k, decision.encode())
            return decision
        wait_s = self.timeout_s + GRACE_S + 60
        try:
            self.store.wait([k], timedelta(seconds=wait_s))
        except Exception as exc:  # rank 0 went silent: nothing sensible is left to do here
            raise TorchrunError(
                f"rank {self.rank}: no word from rank 0 about {sc.id} within {wait_s:.0f}s ({type(exc).__name__})"
            ) from None
        return self.store.get(k).decode()


def _grace(timeout_s: float) -> float:
    return min(GRACE_S, max(2.0, timeout_s / 2))
