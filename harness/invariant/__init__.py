"""The batch-invariant tier: implementations that declare themselves batch-invariant (the adapter attribute
``batch_invariant`` and its ``invariant_forward_backward``, harness/adapters/base.py) trained at every world
size in both data modes and held at bound 0 to each other and to the plain model summing the same micro-batches
in the same tree (``python -m harness run --invariant``): the world task (task), the run and its verdicts (run),
the report section (section). Importing the package registers the section; the section module loads on the
first render only (rank processes import this package for its task)."""

from harness.report.sections import register_section


def _invariant_section(tables: dict) -> list[str]:
    from harness.invariant.section import invariant_section

    return invariant_section(tables)


register_section("invariant", _invariant_section)
