"""The layout CI holds beside the import contracts (pyproject.toml [tool.importlinter], run by `lint-imports`): no
module imports another module's private names (a name with a leading underscore is its module's own)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("harness", "fsdp_impl", "suites", "reports")


def private_imports() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                ours = node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
                found += [
                    f"{path.relative_to(ROOT)}:{node.lineno}: {a.name} from {node.module}"
                    for a in node.names
                    if ours and a.name.startswith("_") and not a.name.startswith("__")
                ]
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []
