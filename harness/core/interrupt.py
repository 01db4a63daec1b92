"""Ctrl-C in the harness's own process (`python -m harness`, `fsdp-harness`): whenever it comes, the process
ends with exit 130 and the one line "interrupted", and never goes on.

`install()` (the first thing harness/__main__.py does) makes SIGINT raise KeyboardInterrupt as Python's own
handler does, with two differences:

- A Ctrl-C that comes while the main thread is importing a module is held until the import is done (see
  [Note: Ctrl-C during an import]); a second Ctrl-C meanwhile raises at once.
- Every Ctrl-C is recorded (`interrupted()`), so that one that some code swallowed still ends the run:
  `check()` raises KeyboardInterrupt again where the harness goes on (after each scenario, before the outputs
  are written), and `finish()` turns the process's exit status into 130.

`said()` prints "interrupted" once and ignores SIGINT from then on: nothing of the way out (the interpreter's
exit, its atexit handlers) can turn the exit into a KeyboardInterrupt of its own.

Only a SIGINT that still has Python's own handler is taken over (one ignored at the start, as a script's
background job or `nohup` leave it, stays ignored), and only from the main thread, where Python runs handlers.
"""

from __future__ import annotations

import signal
import sys
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process that Ctrl-C ended
RECHECK_S = 0.01  # how often a held Ctrl-C looks whether the import it came in has finished

# [Note: Ctrl-C during an import] A KeyboardInterrupt raised while a module executes leaves that module
# half-made. Python removes the module itself from sys.modules, but not the modules it had imported so far,
# and some callers swallow the error: torch's C code imports numpy and, on any exception, clears it and goes on
# without numpy, leaving numpy half-imported in sys.modules for every later `import numpy` to reuse (a run
# then died long after, with "module 'numpy' has no attribute 'maximum'"; another went on until killed). So a
# Ctrl-C that finds the main thread inside the import machinery (a frame of importlib's bootstrap on its
# stack) is held, and a timer (SIGALRM, RECHECK_S) looks again until no import is under way, then raises
# there: between imports, where the KeyboardInterrupt unwinds the run as a Ctrl-C anywhere else does.

_state = {"interrupted": False, "held": False, "said": False}


def install() -> None:
    """Take over SIGINT (module docstring); no effect outside the main thread or where SIGINT is not Python's
    default handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)


def raises_keyboard_interrupt(handler: object) -> bool:
    """Whether SIGINT with `handler` raises KeyboardInterrupt in the main thread (Python's own handler or ours)."""
    return handler is signal.default_int_handler or handler is on_sigint


def on_sigint(signum: int, frame) -> None:
    """The SIGINT handler: KeyboardInterrupt, held while an import is under way (see
    [Note: Ctrl-C during an import])."""
    _state["interrupted"] = True
    if _state["held"] or not _in_import(frame) or not _can_hold():
        _state["held"] = False
        raise KeyboardInterrupt
    _state["held"] = True
    signal.signal(signal.SIGALRM, _recheck)
    signal.setitimer(signal.ITIMER_REAL, RECHECK_S)


def _recheck(signum: int, frame) -> None:
    if not _state["held"]:
        return
    if _in_import(frame):
        signal.setitimer(signal.ITIMER_REAL, RECHECK_S)
        return
    _state["held"] = False
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    raise KeyboardInterrupt


def _can_hold() -> bool:
    """SIGALRM is free for the recheck timer (nothing else in the process uses it)."""
    return (
        signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, _recheck) and not signal.getitimer(signal.ITIMER_REAL)[0]
    )


def _in_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def note() -> None:
    """Record a Ctrl-C taken by a handler of its own (harness.execute.world holds one while it hands a worker
    its task)."""
    _state["interrupted"] = True


def interrupted() -> bool:
    """A Ctrl-C came (whether or not its KeyboardInterrupt reached anyone)."""
    return _state["interrupted"]


def check() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C came: where the harness goes on, one that was swallowed still ends it."""
    if _state["interrupted"]:
        raise KeyboardInterrupt


def said() -> int:
    """Say "interrupted" (once), ignore SIGINT from now on, and give the exit status: the way out of a Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if _state["held"]:
            _state["held"] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    if not _state["said"]:
        _state["said"] = True
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    return EXIT_INTERRUPTED


def finish(status: int) -> int:
    """The process's exit status: `status`, or EXIT_INTERRUPTED (said) if a Ctrl-C came."""
    return said() if _state["interrupted"] else status
