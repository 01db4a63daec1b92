"""Report sections that other packages add: a registry the report renders from, so the report
package never imports the packages whose tables it shows.

A section is a function of the run's tables returning markdown lines, and an empty list when the
tables hold nothing for it (a run without that data gets no section, not an empty one). `render`
places the registered sections, in the order they were registered, after the memory and
communication sections and before the environment. A package registers its section when it is
imported (the per-sample norms do so in harness/per_sample/__init__.py); whoever composes a run and
its report imports those packages first (harness.session.load_report_sections).
"""

from __future__ import annotations

from collections.abc import Callable

Section = Callable[[dict], list[str]]

_SECTIONS: dict[str, Section] = {}


def register_section(name: str, fn: Section) -> None:
    """Add the section `name`, rendered by `fn(tables) -> list[str]`. Registering a name again
    replaces its function and keeps its place, so importing a package twice changes nothing."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a report section needs a name, got {name!r}")
    if not callable(fn):
        raise TypeError(f"report section '{name}' must be a function of the tables, got {fn!r}")
    _SECTIONS[name] = fn


def registered_sections() -> tuple[str, ...]:
    """The names of the registered sections, in the order they render."""
    return tuple(_SECTIONS)


def section_lines(tables: dict) -> list[str]:
    """Every registered section's lines for these tables, in registration order."""
    return [line for fn in _SECTIONS.values() for line in fn(tables)]
