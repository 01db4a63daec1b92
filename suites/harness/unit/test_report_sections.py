"""Sections other packages add to the report (harness.report.sections): the per-sample norms are
rendered from every entry point when the tables hold them, and the report package never imports the
per-sample package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import harness.per_sample  # noqa: F401  (registers its section, as the entry points do)
from harness.per_sample.section import per_sample_section
from harness.report import markdown as report
from harness.report import sections
from harness.tables.store import save_tables

from . import synthetic_tables as syn

REPORT_PACKAGE = Path(report.__file__).parent
PER_SAMPLE_HEAD = "## Per-sample gradient norms"


def _tables(per_sample: bool = True) -> dict:
    tables = syn.make_tables(world_sizes=(1, 2), modes=("split",))
    return {**tables, **syn.make_per_sample_tables()} if per_sample else tables


def _fresh(code: str) -> subprocess.CompletedProcess:
    """`code` in a new interpreter: nothing imported beforehand registers a section."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPORT_PACKAGE.parent.parent
    )


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    froms = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return (
        names
        | froms
        | {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    )


@pytest.mark.ci  # a fresh interpreter
def test_the_report_package_does_not_import_the_per_sample_package():
    for path in sorted(REPORT_PACKAGE.glob("*.py")):  # module-level and lazy imports alike
        found = {m for m in _imported_modules(path) if m.startswith("harness.per_sample")}
        assert not found, f"{path.name} imports {sorted(found)}"
    out = _fresh(
        "import sys, harness.report.markdown, harness.report.sections\n"
        "print(sorted(m for m in sys.modules if m.startswith('harness.per_sample')))"
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_importing_the_per_sample_package_registers_its_section_without_a_cycle():
    out = _fresh(
        "import harness.per_sample\nfrom harness.report.sections import registered_sections\n"
        "print(registered_sections())"
    )
    assert out.returncode == 0 and out.stdout.strip() == "('per_sample',)", out.stdout + out.stderr


def test_the_per_sample_section_renders_after_communication_when_its_tables_exist(tmp_path, fast_plots):
    tables = _tables()
    text = report.write_report(tables, syn.ENV, tmp_path / "r.md").read_text(encoding="utf-8")
    assert "per_sample" in sections.registered_sections()
    assert text.index("## Communication") < text.index(PER_SAMPLE_HEAD) < text.index("## Environment")
    assert "\n".join(per_sample_section(tables)) in text
    assert PER_SAMPLE_HEAD not in report.write_report(_tables(per_sample=False), syn.ENV, tmp_path / "s.md").read_text(
        encoding="utf-8"
    )


def test_registered_sections_render_in_order_and_an_empty_one_adds_nothing(tmp_path, fast_plots, monkeypatch):
    monkeypatch.setattr(sections, "_SECTIONS", dict(sections._SECTIONS))
    sections.register_section("first", lambda tables: ["## First", "", f"{len(tables)} tables", ""])
    sections.register_section("nothing", lambda tables: [])
    sections.register_section("second", lambda tables: ["## Second", ""])
    sections.register_section("first", lambda tables: ["## First again", ""])  # replaced, same place
    assert sections.registered_sections()[-3:] == ("first", "nothing", "second")
    text = report.write_report(_tables(), {}, tmp_path / "r.md").read_text(encoding="utf-8")
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads[-5:] == ["## Communication", PER_SAMPLE_HEAD, "## First again", "## Second", "## Environment"]
    with pytest.raises(ValueError):
        sections.register_section("", lambda tables: [])
    with pytest.raises(TypeError):
        sections.register_section("not a function", ["## lines"])


@pytest.mark.ci  # two fresh interpreters
def test_every_entry_point_renders_the_per_sample_section(tmp_path):
    """`python -m harness report` and a Session's outputs, each in a new interpreter: whoever renders
    imports the per-sample package, so the section is there whenever the tables hold it."""
    stored = tmp_path / "run_tables"
    save_tables(_tables(), syn.ENV, stored)
    out = _fresh(
        f"from harness.cli import main\nmain(['report', {str(stored)!r}, '--report', {str(tmp_path / 'cli.md')!r}])"
    )
    assert out.returncode == 0, out.stdout + out.stderr
    session = _fresh(
        "from pathlib import Path\nfrom harness.options import MatrixOptions\n"
        "from harness.phases import RunResult\nfrom harness.session import Session, SessionOptions\n"
        f"from harness.tables.store import load_tables\ntables, env = load_tables(Path({str(stored)!r}))\n"
        f"s = Session(SessionOptions(MatrixOptions(), report=Path({str(tmp_path / 'session.md')!r})))\n"
        "s.result = RunResult([], tables, [], env, 0.0)\ns.write_outputs()"
    )
    assert session.returncode == 0, session.stdout + session.stderr
    for name in ("cli.md", "session.md"):
        text = (tmp_path / name).read_text(encoding="utf-8")
        assert text.index("## Communication") < text.index(PER_SAMPLE_HEAD) < text.index("## Environment"), name
