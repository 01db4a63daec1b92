"""How this process was launched: by torchrun or not, which rank, and whether the matrix fits the
job. Torch-free, so that the CLI knows before torch loads, and a matrix too large for the job is one
usage line before anything runs (harness.session), said by rank 0 alone (harness.cli, `let_rank_0_say`).
"""

from __future__ import annotations

import argparse
import os
import time

TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR")
PEER_WAIT_MIN_S = 5.0  # the least wait for what another process of the job does on starting


class TorchrunUsageError(argparse.ArgumentTypeError):
    """The matrix does not fit the job (more ranks than torchrun started); one line, exit 2."""


class NotLaunchedHere(TorchrunUsageError):
    """torchrun's variables are left over from another job: there is no job, and no rank 0 to speak
    for it, so the process that meets it says it at once (harness.execute.torchrun.check_launched_here)."""


def launched_by_torchrun() -> bool:
    """Started by torchrun: its elastic agent sets TORCHELASTIC_RUN_ID (torch's own test,
    dist.is_torchelastic_launched) besides RANK / WORLD_SIZE / MASTER_ADDR, which alone may be
    stale exports in the user's shell."""
    return all(k in os.environ for k in TORCHRUN_VARIABLES)


def a_torchrun_rank_but_0() -> bool:
    """A process of a torchrun job other than rank 0, which speaks for the job."""
    return launched_by_torchrun() and os.environ["RANK"] != "0"


def check_job_fits(world_sizes, job_size: int) -> None:
    """TorchrunUsageError if a world size needs more ranks than the torchrun job has."""
    too_big = sorted({w for w in world_sizes if w > job_size})
    if too_big:
        raise TorchrunUsageError(
            f"--world-sizes: {','.join(map(str, too_big))} need more ranks than torchrun started "
            f"({job_size}); launch at least {too_big[-1]} (e.g. --nproc_per_node={too_big[-1]}) or drop them"
        )


def peer_wait_s() -> float:
    """How long to wait for what another process of the job does on starting (rank 0 opening the
    job's store, or saying a usage error): it starts up as this process did (interpreter, torch,
    harness, options), so twice this process's age so far, at least PEER_WAIT_MIN_S."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        age = PEER_WAIT_MIN_S
    return max(PEER_WAIT_MIN_S, 2 * age)


def let_rank_0_say() -> None:
    """On a torchrun rank other than 0 that stops on a usage error: wait, silent, for rank 0 to say
    it and end the job. The same options in the same job give rank 0 the same error; once rank 0
    exits, torchrun stops this process (SIGTERM). Every rank exiting at once instead lets torchrun
    stop rank 0 before it has said anything (seen: the first rank to exit ends the job). Returns after
    `peer_wait_s()` if the job goes on, so that an error of this rank's own (its node's) is said too."""
    time.sleep(peer_wait_s())
