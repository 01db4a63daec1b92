"""The suites' tiers: a test marked `ci` runs with `--ci` (the CI tier: `.ci/run` runs it after the README's
test command), one marked `slow` with `--slow`, which runs every tier; the rest always (the default tier).
The options and the hook are the suites' own (suites/conftest.py), not the harness's plugin: a project that
loads the plugin keeps its own markers of those names."""

from __future__ import annotations

import pytest

SKIP_SLOW = "slow tier: run with --slow"
SKIP_CI = "CI tier: run with --ci (.ci/run does)"


def add_options(parser) -> None:
    group = parser.getgroup("suites", "the suites' tiers")
    group.addoption(
        "--ci",
        action="store_true",
        help="also run tests marked ci (the CI tier: processes the tests start, repeated cells)",
    )
    group.addoption("--slow", action="store_true", help="also run tests marked slow or ci (every tier)")


def skip_by_tier(config, items) -> None:
    """Mark skipped the items whose tier the options leave out (by their markers, never their names)."""
    if config.getoption("--slow"):
        return
    ci = config.getoption("--ci")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.skip(reason=SKIP_SLOW))
        elif item.get_closest_marker("ci") is not None and not ci:
            item.add_marker(pytest.mark.skip(reason=SKIP_CI))
