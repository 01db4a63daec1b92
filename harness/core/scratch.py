"""The temp dir a run writes into (TMPDIR): the worlds' FileStore rendezvous, every step's parameter
snapshot, checkpoints. Checked before a run starts (harness.preflight); a write into it that fails
while the run goes on ends the run with one line (`ScratchError`), since no scenario is to blame.

Torch-free: the parent checks it before torch loads, and a rank's task raises it from its writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator

# a full disk or quota: never the implementation's doing, whatever it was writing
_FULL = (errno.ENOSPC, errno.EDQUOT)
_PROBE_BYTES = 4096  # one block: a probe that allocates no block would pass on a full disk


class ScratchError(RuntimeError):
    """The temp dir cannot take the run's files: one line. It ends the run rather than failing the
    scenario that hit it (a world's rank sends it to the parent as it is: `ends_the_run`)."""

    ends_the_run = True


def unwritable(folder: str) -> str | None:
    """Why a file cannot be written in `folder` (the OS's reason), or None when a probe file of one
    block was written, synced and removed there."""
    try:
        fd, path = tempfile.mkstemp(dir=folder, prefix=".fsdp-harness-probe-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * _PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            os.unlink(path)
    except OSError as e:
        return e.strerror or str(e)
    return None


def temp_dir() -> str:
    """The temp dir the run will write into; ScratchError when it cannot take a file. A TMPDIR that is
    set but unusable is named as such: Python's tempfile would silently use /tmp instead."""
    wanted = os.environ.get("TMPDIR")
    if wanted:
        problem = "not a directory" if os.path.exists(wanted) and not os.path.isdir(wanted) else None
        problem = problem or unwritable(wanted)
        if problem:
            raise ScratchError(
                f"TMPDIR {wanted} is not writable: {problem} (the run's rendezvous files, parameter "
                "snapshots and checkpoints go there; point TMPDIR at a writable folder or unset it)"
            )
    folder = tempfile.gettempdir()
    problem = unwritable(folder)
    if problem:
        raise ScratchError(f"the temp dir {folder} is not writable: {problem} (set TMPDIR to a writable folder)")
    return folder


@contextlib.contextmanager
def writing_into(folder: str | os.PathLike) -> Iterator[None]:
    """A block that writes under `folder` in the temp dir: a failure that is the temp dir's (a full disk,
    or `folder` refusing a probe file afterwards) becomes ScratchError; any other propagates as it is."""
    try:
        yield
    except Exception as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.errno in _FULL else None
        reason = reason or (unwritable(os.fspath(folder)) if os.path.isdir(folder) else None)
        if reason is None:
            raise
        raise ScratchError(
            f"the temp dir {tempfile.gettempdir()} cannot take the run's files: {reason} "
            f"(writing under {os.fspath(folder)}; free space there or set TMPDIR to another "
            f"folder)"
        ) from exc
