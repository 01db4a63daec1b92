"""Start multiprocessing's forkserver by forking this process, where that is safe, in place of a new interpreter.

multiprocessing starts its forkserver as ``python -c 'from multiprocessing.forkserver import main; ...'``: a
fresh interpreter that imports the whole preload (torch, torch.distributed, torch._inductor.config, the worker
module: seconds of CPU) while the process that starts it (the CLI, a pytest worker) has torch and
torch.distributed imported already (most of those seconds). Forked from that process, the server imports only
what its parent lacks, then runs the same ``forkserver.main`` loop; what it forks for each world worker is what
the executed server would fork. What either costs: reports/performance.md#world-start.

A fork copies one thread. So the fork is made only where this process has a single thread, counted by the
kernel (an OpenMP pool that torch started, numpy's OpenBLAS pool, a gloo thread, faulthandler's watchdog would
be missing in the child, and a lock one of them held would stay held); elsewhere, and off Linux,
multiprocessing's own start runs. The child is made to look like an executed server before it serves: it keeps
only the descriptors an executed server would have (stdin, stdout, stderr, the listener and the alive pipe: a
copy of a world's lifeline pipe would keep that world's workers alive after its parent died), signal handlers
the program installed go back to their defaults (an ignored signal stays ignored, as across exec),
faulthandler is off, and the parent's objects are frozen out of the collector (none of their finalizers may
run in the server: they would close descriptors the server has since reused). The server's command line stays
its parent's; its kernel name (/proc/<pid>/comm) is TITLE, and `is_forkserver` tells either kind from the
outside.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import sys
import threading

TITLE = b"fsdp-forkserver"  # the forked server's name in /proc/<pid>/comm (at most 15 bytes)


def single_threaded() -> bool:
    """True if the kernel counts one thread in this process (False where it cannot say)."""
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        return False
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Threads:"):
                    return int(line.split()[1]) == 1
    except OSError:
        pass
    return False


def start(server, preload: list[str]) -> bool:
    """Fork ``server`` (multiprocessing.forkserver's ForkServer instance) from this process if it is not
    running and this process is single-threaded; False where nothing was done (the caller starts it the
    usual way). Mirrors ``ForkServer.ensure_running`` except for how the server process is made."""
    from multiprocessing import connection, util

    if not sys.platform.startswith("linux") or not single_threaded():
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            pid, _ = os.waitpid(server._forkserver_pid, os.WNOHANG)
            if not pid:
                return True  # still running
            os.close(server._forkserver_alive_fd)
            server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # every client holds alive_w: when all are gone, the server ends
            # no Python signal handler may run inside the fork's own Python callbacks (logging's lock release):
            # a KeyboardInterrupt raised there is printed and lost. SIGALRM is the timer that raises a Ctrl-C held
            # through an import (harness/core/interrupt.py); the caller blocks SIGINT. One already caught runs its
            # handler here, before the fork.
            before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            try:
                util._flush_std_streams()  # else the child's copies of buffered output would be written twice
                pid = os.fork()
                if pid == 0:
                    signal.pthread_sigmask(signal.SIG_SETMASK, before)
                    _serve(listener.fileno(), alive_r, preload)  # never returns
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
                os.close(alive_r)
            server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve(listener_fd: int, alive_r: int, preload: list[str]) -> None:
    """The forked child: become an executed forkserver's equal, then run its loop until the alive pipe closes."""
    code = 1
    try:
        gc.freeze()  # the parent's objects, garbage included: never collected, never finalised here
        _keep_only(0, 1, 2, listener_fd, alive_r)
        _signals_as_after_exec()
        faulthandler.disable()
        _name(TITLE)
        from multiprocessing import forkserver

        forkserver._forkserver._lock = threading.Lock()  # the parent's copy was held at the fork
        forkserver.main(listener_fd, alive_r, preload)
        code = 0
    except SystemExit as exc:  # how forkserver.main ends when its last client is gone
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException:
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
    finally:
        os._exit(code)  # never the parent's atexit handlers, nor its cleanup of what it owns


def _keep_only(*fds: int) -> None:
    """Close every descriptor but ``fds``."""
    low = 0
    for fd in [*sorted(set(fds)), os.sysconf("SC_OPEN_MAX")]:
        if low < fd:  # never an empty range: CPython makes closerange(n, n) close everything from n up
            os.closerange(low, fd)
        low = fd + 1


def _signals_as_after_exec() -> None:
    """What exec leaves: a caught signal goes back to its default action, an ignored one stays ignored, and
    Python's start installs its SIGINT handler (the server ignores SIGINT itself once its imports are done)."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler):
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _name(title: bytes) -> None:
    """Set the kernel's name of this process (what `ps -o comm` and /proc/<pid>/comm show)."""
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(title[:15])
    except OSError:
        pass


def is_forkserver(pid: int) -> bool:
    """True if ``pid`` is a forkserver, executed by multiprocessing or forked here (a world worker forked by
    either keeps that mark until it execs)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"multiprocessing.forkserver" in f.read():
                return True
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() == TITLE
    except OSError:
        return False
