"""A run's outcome (harness.core.outcome): no PASS without the implementation under test, the
reference's verdicts counted apart, and what the gate compared; and the session's summary line and
exit status, which read it."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.checks.registry import verdict_table
from harness.core.outcome import FAILED, NOT_RUN, PASSED, outcome
from harness.core.verdict import FAIL, PASS, SKIP, UNSUPPORTED, Verdict
from harness.session import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NOT_RUN, EXIT_OK, EXIT_USAGE, Session

REF = "reference-mlp-ws1-replicated-sgd"


def _cells(*rows: tuple[str, str, str]) -> pd.DataFrame:
    """(scenario, impl, state) rows; state 'ok', 'unsupported' or 'error' as the scenarios table holds it."""
    return pd.DataFrame(
        [
            {
                "scenario": s,
                "impl": i,
                "status": "error" if st == "error" else st,
                "error": "RuntimeError: boom" if st == "error" else "no method" if st == UNSUPPORTED else "",
            }
            for s, i, st in rows
        ]
    )


def _verdicts(*rows: tuple[str, str, str]) -> pd.DataFrame:
    """(check, scenario, status) rows."""
    return verdict_table([Verdict(c, s, st, None, None, message=f"{c} said {st}") for c, s, st in rows])


def _case(impl_states: dict[str, list[str]], ref_status: str = PASS, extra=()):
    """Cells and verdicts of a run: each implementation's scenarios in the given states (a 'completed'
    verdict each: pass when it ran, fail when it errored, unsupported when not run) and the reference
    with one verdict of `ref_status`."""
    rows, verdicts = [(REF, "reference", "ok")], [("completed", REF, ref_status)]
    for impl, states in impl_states.items():
        for i, st in enumerate(states):
            sid = f"{impl}-mlp-ws{i + 1}-replicated-sgd"
            rows.append((sid, impl, st))
            verdicts.append(("completed", sid, {"ok": PASS, "error": FAIL, UNSUPPORTED: UNSUPPORTED}[st]))
    return _cells(*rows), _verdicts(*verdicts, *extra)


@pytest.mark.parametrize(
    "states, ref, word",
    [
        ({"fsdp_impl": ["ok", "ok"]}, PASS, PASSED),
        ({"fsdp_impl": [UNSUPPORTED, UNSUPPORTED]}, PASS, NOT_RUN),  # the passes are the reference's
        ({"fsdp_impl": ["error", "error"]}, PASS, FAILED),  # raised in every scenario: a crash is no skip
        ({"fsdp_impl": ["ok", "error"]}, PASS, FAILED),
        ({"fsdp_impl": ["ok", "ok"]}, FAIL, FAILED),  # a broken yardstick is no pass
        ({"fsdp_impl": ["ok", "ok"], "mine": [UNSUPPORTED]}, PASS, NOT_RUN),  # one of two was not verified
        ({"fsdp_impl": ["ok", UNSUPPORTED], "mine": ["ok", "error"]}, PASS, FAILED),  # a failure outranks it
        ({"fsdp_impl": [UNSUPPORTED], "mine": ["error"]}, PASS, FAILED),
        ({"fsdp_impl": [UNSUPPORTED, UNSUPPORTED]}, FAIL, FAILED),  # nothing applied, but the yardstick broke
    ],
)
def test_the_word_counts_only_what_the_implementations_under_test_ran(states, ref, word):
    o = outcome(*_case(states, ref))
    assert o.word == word
    assert [(r.impl, r.ran, r.unsupported, r.errored) for r in o.impls] == [
        (i, s.count("ok"), s.count(UNSUPPORTED), s.count("error")) for i, s in states.items()
    ]
    assert o.not_run == [i for i, s in states.items() if "ok" not in s]


def test_the_reference_verdicts_are_counted_apart():
    o = outcome(*_case({"fsdp_impl": [UNSUPPORTED, UNSUPPORTED]}, extra=[("finite", REF, PASS)]))
    assert o.counts[PASS] == 0 and o.counts[UNSUPPORTED] == 2 and o.reference[PASS] == 2
    assert o.runs == "fsdp_impl: 0 ran, 2 unsupported"


def test_the_reference_alone_named_is_the_implementation_under_test():
    o = outcome(_cells((REF, "reference", "ok")), _verdicts(("completed", REF, PASS)))
    assert o.word == PASSED and o.counts[PASS] == 1 and o.runs == "reference: 1 ran, 0 unsupported"


def test_the_gate_says_what_it_compared_or_why_it_compared_nothing():
    sid = "fsdp_impl-mlp-ws1-replicated-sgd"
    base = [("gate:step_time", "", SKIP), ("gate:scenario", "x", SKIP)]
    o = outcome(*_case({"fsdp_impl": ["ok"]}, extra=base + [("gate:loss", sid, PASS), ("gate:peak_mem", sid, FAIL)]))
    # a run-wide skip of a field (not one whose gate is off) is said, with its reason
    assert o.gate == (
        "gate: 2 figures compared with the baseline, 1 outside tolerance; step_time not compared: gate:step_time said "
        "skip"
    )
    assert o.word == FAILED
    o = outcome(*_case({"fsdp_impl": ["ok"]}, extra=base + [("gate:coverage", "", SKIP)]))
    assert o.gate == "gate:coverage said skip" and o.word == PASSED
    assert outcome(*_case({"fsdp_impl": ["ok"]})).gate == ""  # no baseline, no gate


def test_not_run_and_interrupted_have_exit_statuses_of_their_own():
    assert len({EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUN, EXIT_INTERRUPTED}) == 5


def _session(states: dict[str, list[str]], extra=()):
    cells, verdicts = _case(states, extra=extra)
    session = Session.__new__(Session)
    session.options = type("O", (), {"report": None})()
    session.report = None
    session.result = type(
        "R",
        (),
        {
            "verdicts": [
                Verdict(r.check, r.scenario, r.status, None, None, message=r.message) for r in verdicts.itertuples()
            ],
            "tables": {"scenarios": cells},
            "wall_s": 1.0,
        },
    )()
    return session


@pytest.mark.parametrize(
    "states, code, head",
    [
        ({"fsdp_impl": ["ok"]}, EXIT_OK, "PASS: 1 passed, 0 failed"),
        ({"fsdp_impl": ["ok", "error"]}, EXIT_FAILED, "FAIL: 1 passed, 1 failed"),
        (
            {"fsdp_impl": [UNSUPPORTED]},
            EXIT_NOT_RUN,
            "NOT RUN: 0 passed, 0 failed, 0 known deviations, 0 skipped, 1 unsupported",
        ),
    ],
)
def test_the_summary_line_and_exit_status_follow_the_outcome(states, code, head):
    session = _session(states)
    assert session.exit_status() == code
    line = session.summary_line()
    assert line.startswith(head), line
    assert "(the reference's runs apart: 1 passed, 0 failed)" in line
    impl = next(iter(states))
    s = states[impl]
    assert f"{impl}: {s.count('ok')} ran, {s.count(UNSUPPORTED)} unsupported" in line


def test_the_summary_line_says_when_the_gate_compared_nothing():
    line = _session({"fsdp_impl": ["ok"]}, extra=[("gate:coverage", "", SKIP)]).summary_line()
    assert "; gate:coverage said skip;" in line


def test_the_report_reads_not_run_when_only_the_reference_passed():
    from harness.report.verdicts import overall_line

    cells, verdicts = _case({"fsdp_impl": [UNSUPPORTED, UNSUPPORTED]})
    line = overall_line(verdicts, cells)
    assert line.startswith("**Overall: NOT RUN** — 0 passed / 0 failed"), line
    assert "fsdp_impl: 0 ran, 2 unsupported" in line and "apart: 1 passed / 0 failed" in line


def test_an_implementation_that_raised_in_every_scenario_fails_naming_its_error():
    """A crash everywhere is a FAIL (exit 1) whose summary names the error, never NOT RUN (exit 3), which a CI job
    may read as 'skipped'; NOT RUN stays for an implementation to which nothing applied."""
    error = (
        "rank 0 of World(1, 'gloo') failed in harness.train.task:train_scenario:\n"
        "Traceback (most recent call last):\n"
        '  File "mine/adapter.py", line 4, in wrap\n'
        "    shard(model)\n"
        "RuntimeError: my shard() is broken\n"
        "rank 1 failed too: RuntimeError: my shard() is broken"
    )
    cells, verdicts = _case({"mine": ["error", "error"]})
    cells.loc[cells.impl == "mine", "error"] = error
    session = _session({"mine": ["error", "error"]})
    session.result.tables["scenarios"] = cells
    assert session.exit_status() == EXIT_FAILED
    line = session.summary_line()
    assert line.startswith("FAIL: "), line
    assert "mine: 0 ran, 0 unsupported, 2 errored (first: RuntimeError: my shard() is broken)" in line, line
    assert _session({"mine": [UNSUPPORTED, UNSUPPORTED]}).exit_status() == EXIT_NOT_RUN
