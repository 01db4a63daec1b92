"""Ctrl-C in the harness's own process (harness/core/interrupt.py), in this process: one that comes during an
import is held until the import is done, and one that something swallowed still ends the run. The CLI's
moments are suites/faults/test_early_ctrl_c.py's."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from harness.core import interrupt


@pytest.fixture
def taken_over(monkeypatch):
    """SIGINT taken over as `python -m harness` takes it, with a fresh record; restored afterwards."""
    monkeypatch.setattr(interrupt, "_state", {"interrupted": False, "held": False, "said": False})
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGALRM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.install()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGALRM, before[1])


def _module(tmp_path, monkeypatch, name: str) -> None:
    """A module that gets a Ctrl-C half way through its own import, then goes on to define LAST."""
    (tmp_path / f"{name}.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.05)\nLAST = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_ctrl_c_during_an_import_is_held_until_the_import_is_done(tmp_path, monkeypatch, taken_over):
    _module(tmp_path, monkeypatch, "interrupted_halfway")
    with pytest.raises(KeyboardInterrupt):
        __import__("interrupted_halfway")
        time.sleep(5)  # the held Ctrl-C is raised here, once no import is under way
    assert sys.modules["interrupted_halfway"].LAST  # the module is whole
    assert interrupt.interrupted()


def test_a_second_ctrl_c_during_the_import_raises_at_once(tmp_path, monkeypatch, taken_over):
    name = "interrupted_twice"
    (tmp_path / f"{name}.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.001)\n"
        "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\nLAST = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        __import__(name)
    assert time.monotonic() - started < 5 and name not in sys.modules


def test_a_swallowed_ctrl_c_still_ends_the_run_with_130_and_one_line(taken_over, capsys):
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass  # what a library that swallows it does
    with pytest.raises(KeyboardInterrupt):
        interrupt.check()
    assert interrupt.finish(0) == interrupt.EXIT_INTERRUPTED
    assert interrupt.said() == interrupt.EXIT_INTERRUPTED  # said once, however often asked
    assert capsys.readouterr().err == "interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # nothing on the way out can raise it again
