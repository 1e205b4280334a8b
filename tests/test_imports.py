"""The package's modules: every one imports on its own, no import runs in a circle, and
docs/architecture.md's module table names each of them.

The graph is read from the source (every ``import`` and ``from ... import`` of a supervisor module,
at any depth of a module, ``TYPE_CHECKING`` blocks included), so a circle that Python would only
meet in some import order is still one.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import supervisor

PACKAGE = Path(supervisor.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The supervisor modules ``name``'s source imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            # ``from . import decoder``: the name may be a module of its own.
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def a_cycle() -> list[str] | None:
    """One circle of imports, as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for other in sorted(GRAPH[name]):
            if (found := visit(other)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(GRAPH):
        if (found := visit(name)) is not None:
            return found
    return None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_the_graph_is_read_from_the_source() -> None:
    assert "supervisor.routes.decision" in GRAPH["supervisor.completion"]
    assert "supervisor.statefile" in GRAPH["supervisor.prefix.files"]
    assert "supervisor.decoder" in GRAPH["supervisor.routes.stored"]  # from .. import decoder


def test_no_import_runs_in_a_circle() -> None:
    assert a_cycle() is None, " -> ".join(a_cycle() or [])


def test_the_architecture_module_table_names_every_module_and_no_other() -> None:
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named = {f"supervisor/{path}" for path in re.findall(r"`([a-z_/]+\.py)`", table)}
    modules = {str(path.relative_to(PACKAGE.parent)) for path in MODULES.values() if path.name != "__init__.py"}
    assert sorted(modules - named) == []
    rows = {f"supervisor/{path}" for path in re.findall(r"^\| `([a-z_/]+\.py)`", table, re.MULTILINE)}
    assert sorted(rows - modules) == []
