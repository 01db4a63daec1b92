"""Per-sample gradient norms (DP-SGD clipping): the rank tasks and float64 truth (tasks), the run
over world sizes and data modes (run), and the report section (section).

Importing the package registers the section with the report (harness.report.sections), so a report
rendered from tables that hold per-sample norms shows them; the report package itself never imports
this one. The section module (pandas, the report's helpers) loads on the first render only: rank
processes import this package for its tasks and need neither."""

from harness.report.sections import register_section


def _per_sample_section(tables: dict) -> list[str]:
    from harness.per_sample.section import per_sample_section

    return per_sample_section(tables)


register_section("per_sample", _per_sample_section)
