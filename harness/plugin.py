"""pytest plugin: the harness's options, one `Session` per pytest run, its outputs at the end.

Registered by the `pytest11` entry point and by the root conftest.py. Tests reach the run through
the `harness_run` fixture; `matrix_options(config)` gives the matrix tests parametrize on. The
matrix runs lazily, once, on the first test that needs it, and only the part the selected tests
need: `-k fsdp_impl-mlp-ws2` runs that scenario and the runs it is compared with, and skipped tests
(the suites' slow and CI tiers, suites/tiers.py) need nothing (suites/harness/end_to_end/test_equivalence.py). At the end the
session writes the same report, tables and baseline as `python -m harness run` with the same
options, and a failed verdict fails the pytest run even where no test asserted on it; so does a run
that reads NOT RUN (an implementation under test ran no scenario to its end: its tests are all
skips), with pytest's own "tests failed" status and the reason on the terminal.

Under pytest-xdist (`-n N`) the matrix still runs once: the first worker that needs it runs it
while holding a lock on a file in a folder the controller made, and leaves the result there; the
other workers wait on the lock and load it; the controller writes the outputs and decides the
exit status from it. [Note: xdist workers collect the same items, so each computes the same
selection.] The run records the pytest command line that made it (`invocation`): on a worker, the
controller's, which the controller hands to its workers with the shared folder.
"""

from __future__ import annotations

import argparse
import fcntl
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from harness import options as opt
from harness.core.environment import command_line
from harness.session import EXIT_FAILED, Session, session_options

_SESSION = pytest.StashKey[Session]()
_SELECTED = pytest.StashKey[object]()  # set of scenario ids, or None for the whole matrix
_SHARED = pytest.StashKey[Path]()  # xdist controller: the folder workers share the result through
_SHARED_KEY = "fsdp_harness_shared"
_COMMAND_KEY = "fsdp_harness_command"
RESULT_FILE, RAN_BY_FILE = "result.pickle", "ran_by"
MATRIX_FIXTURE = "harness_run"


def pytest_addoption(parser):
    # argparse names the program after sys.argv[0]: under `python -m pytest` (the README's command)
    # that is pytest's "__main__.py", which tells the reader nothing in a usage error
    if parser.prog == "__main__.py":
        parser.prog = "python -m pytest"
    group = parser.getgroup("fsdp-harness", "FSDP equivalence harness")
    add = lambda name, **kw: group.addoption(name, **kw)  # noqa: E731
    opt.add_matrix_arguments(add)
    opt.add_output_arguments(add)
    opt.add_gate_arguments(add)


def pytest_configure(config):
    if _is_controller(config):
        config.stash[_SHARED] = Path(tempfile.mkdtemp(prefix="fsdp-harness-xdist-"))
    try:
        if not hasattr(config, "workerinput"):  # an option given twice (harness/options.py check_not_repeated)
            opt.check_not_repeated(config.invocation_params.args)
        # an xdist worker's options are its controller's, which ran preflight on them (building the models
        # imports torch: seconds per worker, for nothing)
        options = session_options(config.option, preflight=not hasattr(config, "workerinput"))
        config.stash[_SESSION] = Session(options, say=lambda line: _say(config, line), command=invocation(config))
    except argparse.ArgumentTypeError as e:
        raise pytest.UsageError(str(e)) from None


def pytest_collection_finish(session):
    """Which scenarios the selected tests need: those they are parametrized on, or every one. A test
    that will be skipped (the suites' slow or CI tier's without --slow or --ci) needs none."""
    needing = [
        i
        for i in session.items
        if MATRIX_FIXTURE in getattr(i, "fixturenames", ()) and i.get_closest_marker("skip") is None
    ]
    ids = [getattr(i, "callspec", None) and i.callspec.params.get("scenario_id") for i in needing]
    session.config.stash[_SELECTED] = None if any(x is None for x in ids) else set(ids)


def invocation(config) -> str:
    """The pytest command line that made this run, as its user typed it: the controller's arguments
    on an xdist worker (whose own argv is execnet's `-c`)."""
    handed = getattr(config, "workerinput", {}).get(_COMMAND_KEY)
    if handed is not None:
        return handed
    program = "python -m pytest" if Path(sys.argv[0]).name == "__main__.py" else "pytest"
    return command_line(program, config.invocation_params.args)


def matrix_options(config) -> opt.MatrixOptions:
    return config.stash[_SESSION].options.matrix


def get_run(config):
    """The session's RunResult: the matrix runs on first use, once per pytest run (xdist included)."""
    harness = config.stash[_SESSION]
    shared = getattr(config, "workerinput", {}).get(_SHARED_KEY)
    if shared is None or harness.result is not None:
        return harness.run(config.stash.get(_SELECTED, None))
    with open(Path(shared) / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first worker runs the matrix; the others wait here
        result_file = Path(shared) / RESULT_FILE
        if result_file.exists():
            harness.result = pickle.loads(result_file.read_bytes())
        else:
            harness.run(config.stash.get(_SELECTED, None))
            worker = config.workerinput.get("workerid", "?")
            (Path(shared) / RAN_BY_FILE).write_text(f"{worker} {len(harness.result.scenarios)}")
            tmp = result_file.with_suffix(".tmp")
            tmp.write_bytes(pickle.dumps(harness.result))
            tmp.replace(result_file)
    return harness.result


def _is_controller(config) -> bool:
    """The process that runs no tests itself: xdist's controller (with -n N, N > 0)."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: tell each worker where the shared result goes and what command made the run."""
    node.workerinput[_SHARED_KEY] = str(node.config.stash[_SHARED])
    node.workerinput[_COMMAND_KEY] = node.config.stash[_SESSION].command


def _say(config, line: str) -> None:
    """Progress on the terminal even while pytest captures output."""
    line = f"[fsdp-harness] {line}"
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        sys.stderr.write(line + "\n")
        return
    with capman.global_and_fixture_disabled():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def harness_run(request):
    """The session's RunResult (harness.phases.RunResult): tables, verdicts, environment.
    A temp dir that fills up during the run ends the pytest run with its one line."""
    from harness.core.scratch import ScratchError

    try:
        return get_run(request.config)
    except ScratchError as e:
        pytest.exit(f"error: {e}", returncode=pytest.ExitCode.TESTS_FAILED)


def pytest_sessionfinish(session, exitstatus):
    harness = session.config.stash.get(_SESSION, None)
    if harness is None:
        return
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller writes the outputs
    shared = session.config.stash.get(_SHARED, None)
    if shared is not None:  # the xdist controller: the result a worker left
        result_file = shared / RESULT_FILE
        if result_file.exists():
            harness.result = pickle.loads(result_file.read_bytes())
            worker, n = (shared / RAN_BY_FILE).read_text().split()
            _say(session.config, f"the matrix ran once, in xdist worker {worker}: {n} scenarios")
        shutil.rmtree(shared, ignore_errors=True)
    if harness.result is None:
        return
    from harness.tables.store import OutputError  # (pandas: only once a run has a result to write)

    try:
        status = harness.finish()
    except OutputError as e:
        _say(session.config, f"error: {e}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    _say(session.config, harness.summary_line())
    if status and session.exitstatus == 0:
        for v in harness.failures():
            _say(session.config, f"{v}")
        _say(
            session.config,
            "a failed verdict that no test asserted on fails the run"
            if status == EXIT_FAILED
            else f"NOT RUN: {', '.join(harness.outcome().not_run)} ran no scenario to its end; a run that verified "
            "nothing fails",
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
