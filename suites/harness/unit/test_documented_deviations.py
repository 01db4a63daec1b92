"""docs/checks.md's "Documented deviations" is the list harness/core/policy.py holds (KNOWN_DEVIATIONS and the
per-sample tier's OPACUS_EMPTY_SHARD): every deviation that can make a verdict `known` has a bullet naming its
implementation, its check and its feature, and every implementation and check a bullet names together is one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.checks.registry import all_checks
from harness.core.policy import KNOWN_DEVIATIONS, OPACUS_EMPTY_SHARD

ROOT = Path(__file__).resolve().parents[3]
DEVIATIONS = (*KNOWN_DEVIATIONS, OPACUS_EMPTY_SHARD)


def _bullets() -> list[str]:
    text = (ROOT / "docs" / "checks.md").read_text(encoding="utf-8")
    section = text.split("\n## Documented deviations\n", 1)[1].split("\n## ", 1)[0]
    return [" ".join(b.split()) for b in re.split(r"\n- ", section)[1:]]


def _named(bullet: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", bullet))


@pytest.mark.parametrize("dev", DEVIATIONS, ids=lambda d: f"{d.impl}-{d.check}-{d.feature or 'any'}")
def test_every_deviation_of_the_policy_is_documented(dev):
    names = {dev.impl, dev.check, *([dev.feature] if dev.feature else [])}
    assert any(names <= _named(b) for b in _bullets()), f"no bullet of docs/checks.md names all of {sorted(names)}"


def test_every_implementation_and_check_a_bullet_names_together_is_in_the_policy():
    checks = {c.name for c in all_checks()} | {OPACUS_EMPTY_SHARD.check}
    impls = {d.impl for d in DEVIATIONS}
    pairs = {(d.impl, d.check) for d in DEVIATIONS}
    for bullet in _bullets():
        named = _named(bullet)
        documented = {(i, c) for i in named & impls for c in named & checks}
        assert documented, f"a bullet that names no implementation and check of the policy: {bullet[:120]}"
        assert documented <= pairs, f"documented but not in the policy: {sorted(documented - pairs)}"
