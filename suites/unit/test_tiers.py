"""The test tiers (harness/plugin.py): a test marked `ci` runs with --ci or --slow, one marked `slow` with
--slow only, the rest always; a skipped test says which option runs it."""

from __future__ import annotations

import pytest

from harness.plugin import pytest_collection_modifyitems


class Item:
    """What the hook reads of a collected test: its keywords; what it does to one: add a skip marker."""

    def __init__(self, *markers: str) -> None:
        self.keywords = {"test_x": True, **{m: True for m in markers}}
        self.skips: list[str] = []

    def add_marker(self, marker) -> None:
        assert marker.name == "skip"
        self.skips.append(marker.kwargs["reason"])


class Config:
    def __init__(self, **options: bool) -> None:
        self.options = {"--ci": False, "--slow": False, **{f"--{k}": v for k, v in options.items()}}

    def getoption(self, name: str) -> bool:
        return self.options[name]


@pytest.mark.parametrize("options, runs", [
    ({}, {"default"}),
    ({"ci": True}, {"default", "ci"}),
    ({"slow": True}, {"default", "ci", "slow", "ci+slow"}),
    ({"ci": True, "slow": True}, {"default", "ci", "slow", "ci+slow"}),
])
def test_each_tier_runs_with_its_option_and_slow_runs_every_tier(options, runs):
    items = {"default": Item(), "ci": Item("ci"), "slow": Item("slow"), "ci+slow": Item("ci", "slow")}
    pytest_collection_modifyitems(Config(**options), list(items.values()))
    assert {name for name, item in items.items() if not item.skips} == runs
    for name, item in items.items():
        assert len(item.skips) <= 1, name
        if item.skips:
            assert item.skips[0] == ("slow tier: run with --slow" if "slow" in name else
                                     "CI tier: run with --ci (.ci/run does)"), name
