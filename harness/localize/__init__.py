"""The localiser: where a failing run first parted from its yardstick, to the op (trace, compare, replay).

Importing the package registers the report's "Where it diverged" section (harness.report.sections); rank
processes import it for the tracer and never render."""

from harness.report.sections import register_section


def _section(tables: dict) -> list[str]:
    from harness.localize.section import where_it_diverged

    return where_it_diverged(tables)


register_section("localised", _section)
