"""The suites' tiers (suites/tiers.py): a test marked `ci` runs with --ci or --slow, one marked `slow` with
--slow only, the rest always; a skipped test says which option runs it; a name is not a marker."""

from __future__ import annotations

import pytest

from suites.tiers import SKIP_CI, SKIP_SLOW, skip_by_tier


class Item:
    """What the hook reads of a collected test: its markers (its keywords hold its names too: a test in a
    folder named ci, or a parametrization with that id, is not the CI tier's); what it does: add a skip."""

    def __init__(self, *markers: str) -> None:
        self.markers = set(markers)
        self.keywords = {"test_x[ci]": True, "ci": True, "slow": True, **{m: True for m in markers}}
        self.skips: list[str] = []

    def get_closest_marker(self, name: str):
        return pytest.mark.skip if name in self.markers else None  # any marker object will do

    def add_marker(self, marker) -> None:
        assert marker.name == "skip"
        self.skips.append(marker.kwargs["reason"])


class Config:
    def __init__(self, **options: bool) -> None:
        self.options = {"--ci": False, "--slow": False, **{f"--{k}": v for k, v in options.items()}}

    def getoption(self, name: str) -> bool:
        return self.options[name]


@pytest.mark.parametrize(
    "options, runs",
    [
        ({}, {"default"}),
        ({"ci": True}, {"default", "ci"}),
        ({"slow": True}, {"default", "ci", "slow", "ci+slow"}),
        ({"ci": True, "slow": True}, {"default", "ci", "slow", "ci+slow"}),
    ],
)
def test_each_tier_runs_with_its_option_and_slow_runs_every_tier(options, runs):
    items = {"default": Item(), "ci": Item("ci"), "slow": Item("slow"), "ci+slow": Item("ci", "slow")}
    skip_by_tier(Config(**options), list(items.values()))
    assert {name for name, item in items.items() if not item.skips} == runs
    for name, item in items.items():
        assert len(item.skips) <= 1, name
        if item.skips:
            assert item.skips[0] == (SKIP_SLOW if "slow" in name else SKIP_CI), name


def test_the_harness_plugin_leaves_a_projects_own_markers_and_options_alone():
    """The plugin is loaded in any project that installs the harness: the tiers are the suites' (their
    conftest.py), so a project's own `slow` or `ci` marker is not skipped by it, nor its options taken."""
    import harness.plugin

    class Group:
        def __init__(self) -> None:
            self.names: list[str] = []

        def addoption(self, *names: str, **_kw) -> None:
            self.names += names

    class Parser:
        prog = "pytest"

        def __init__(self) -> None:
            self.group = Group()

        def getgroup(self, *_args, **_kw) -> Group:
            return self.group

    parser = Parser()
    harness.plugin.pytest_addoption(parser)
    assert "--world-sizes" in parser.group.names  # the harness's own options are there
    assert not {"--ci", "--slow"} & set(parser.group.names)
    assert not hasattr(harness.plugin, "pytest_collection_modifyitems")
