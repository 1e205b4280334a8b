"""One meaning per name: a class name is defined once in the package, and a module name once in its
folders, so that a reader who meets ``Plan`` or ``hangup.py`` knows which one is meant.

Read from the source, classes at any depth of a module (a class inside a class or a function is
still one a reader meets)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import supervisor

PACKAGE = Path(supervisor.__file__).parent


def class_names(root: Path) -> dict[str, list[str]]:
    """Each class name defined under ``root``: the modules (paths relative to it) that define it."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                found[node.name].append(str(path.relative_to(root)))
    return found


def twice(names: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: where for name, where in names.items() if len(where) > 1}


def test_every_class_name_is_defined_once_in_the_package() -> None:
    assert twice(class_names(PACKAGE)) == {}


def test_a_class_name_defined_twice_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class Plan:\n    pass\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "c.py").write_text("def f():\n    class Plan:\n        pass\n")
    assert twice(class_names(tmp_path)) == {"Plan": ["a.py", "b/c.py"]}


# Module names two folders share because they mean the same thing in each.
SAME_MEANING = {
    "cli": ["admin/cli.py", "daemon/cli.py"],  # each program's command line: onebitctl's, onebitd's
}


def test_every_module_name_is_used_once_in_the_package() -> None:
    """A module's file name, ``__init__`` and ``__main__`` aside."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            found[path.stem].append(str(path.relative_to(PACKAGE)))
    assert twice(found) == SAME_MEANING
