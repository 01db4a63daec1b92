"""The verbs besides `run` are as careful as it: `localize` says what it starts before it starts it and a replay
that raises is one line, and `plan` answers the largest world size it accepts for a large model in seconds. (Their
bad input is in bad_inputs.py, with run's.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from suites.faults.processes import ENV, ROOT
from suites.faults.scenarios import FA

# the CI tier (--ci; .ci/run runs it): each test is a CLI process
pytestmark = pytest.mark.ci


def _harness(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_localize_says_what_it_starts_on_its_first_line():
    sid = "fsdp_impl-mlp-ws2-split-adamw"
    proc = _harness("localize", sid, "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"localising {sid}: ") and "steps 1-2" in first, proc.stderr
    assert proc.stdout.startswith(f"{sid} against "), proc.stdout


def test_a_replay_that_raises_is_one_line_and_exit_1():
    sid = f"{FA.replace(':', '.')}.forward_rank0-mlp-ws1-replicated-adamw"
    proc = _harness("localize", sid, "--steps", "3")
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[-1].startswith(f"error: the replay of {sid} did not run to its end: "), lines
    assert "injected fault in forward on rank 0" in lines[-1]


def test_plan_answers_the_largest_world_size_it_accepts_in_seconds():
    """The issue's command: gpt2_medium's vocabulary rows are its largest dim 0, the planner's limit. Before, FSDP2
    cut each parameter into that many chunks and gave no table in 90 s."""
    from harness import limits

    rows = limits.model_size("gpt2_medium").largest_rows
    proc = _harness("plan", "--world-sizes", f"1,8,{rows}", timeout=60)
    assert proc.returncode == 0, proc.stderr
    for impl in ("fsdp_impl", "torch_fsdp2"):
        assert any(line.startswith(f"| {impl}") and f"| {rows} " in line for line in proc.stdout.splitlines())
