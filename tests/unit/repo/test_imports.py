"""The package's modules: every one imports on its own, no import runs in a circle, every import runs
down the layers (:data:`LAYERS`, the table docs/architecture.md shows), and docs/architecture.md's
module table names each of them.

The graph is read from the source (every ``import`` and ``from ... import`` of a supervisor module,
at any depth of a module, ``TYPE_CHECKING`` blocks included), so a circle that Python would only
meet in some import order is still one.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

import supervisor

PACKAGE = Path(supervisor.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"

# The layers, lowest first: a module imports only modules of its own layer and of lower ones.  A
# folder of supervisor/ is one layer, and so is each module at its top (``__init__``: the package's
# own, its version).  docs/architecture.md's "Layers" table is this one.
LAYERS = {
    "__init__": 0,
    "errors": 0,
    "reasons": 0,
    "routeline": 0,
    "config": 1,
    "http": 2,
    "supervise": 3,
    "llama": 4,
    "providers": 5,
    "prefix": 6,
    "routes": 7,
    "observe": 8,
    "models": 9,
    "api": 10,
    "admin": 11,
    "daemon": 12,
    "testing": 13,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, modules: Mapping[str, Path] = MODULES) -> set[str]:
    """The modules of ``modules`` (supervisor's) that ``name``'s source imports."""
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
            # ``from . import decoder`` imports the module; ``from .errors import ConfigError``, errors.
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def a_cycle(graph: Mapping[str, set[str]] = GRAPH) -> list[str] | None:
    """One circle of imports in ``graph`` (supervisor's), as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for other in sorted(graph[name]):
            if (found := visit(other)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (found := visit(name)) is not None:
            return found
    return None


def layer(name: str) -> str:
    """The key of :data:`LAYERS` ``name`` is in: its folder, or itself at the top."""
    return name.removeprefix("supervisor").lstrip(".").split(".")[0] or "__init__"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_the_graph_is_read_from_the_source() -> None:
    assert "supervisor.routes.decision" in GRAPH["supervisor.routes.completion"]
    assert "supervisor.llama.statefile" in GRAPH["supervisor.prefix.files"]
    assert "supervisor.llama.decoder" in GRAPH["supervisor.routes.stored"]  # from .. import decoder


def test_no_import_runs_in_a_circle() -> None:
    assert a_cycle() is None, " -> ".join(a_cycle() or [])


def test_every_module_is_in_a_layer() -> None:
    assert sorted({layer(name) for name in MODULES} - LAYERS.keys()) == []


def test_every_import_runs_down_the_layers() -> None:
    upward = [
        f"{name} ({layer(name)}) imports {other} ({layer(other)})"
        for name in sorted(GRAPH)
        for other in sorted(GRAPH[name])
        if LAYERS[layer(other)] > LAYERS[layer(name)]
    ]
    assert upward == []


def test_the_architecture_layer_table_is_this_one() -> None:
    table = DOC.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    shown: dict[str, int] = {}
    for rank, cell in re.findall(r"^\| (\d+) \| ([^|]+) \|", table, re.MULTILINE):
        for key in re.findall(r"`([a-z_]+)(?:/|\.py)`", cell):
            shown[key] = int(rank)
    assert shown == {key: rank for key, rank in LAYERS.items() if key != "__init__"}


def test_the_architecture_module_table_names_every_module_and_no_other() -> None:
    doc = DOC.read_text()
    table = doc.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    named = {f"supervisor/{path}" for path in re.findall(r"`([a-z_/]+\.py)`", table)}
    modules = {str(path.relative_to(PACKAGE.parent)) for path in MODULES.values() if path.name != "__init__.py"}
    assert sorted(modules - named) == []
    rows = {f"supervisor/{path}" for path in re.findall(r"^\| `([a-z_/]+\.py)`", table, re.MULTILINE)}
    assert sorted(rows - modules) == []


# -- the house's limits: modules and functions a reader can hold --------------------------------------

MODULE_LINES = 400
FUNCTION_LINES = 80


def _longer_modules_in_the_doc() -> dict[str, int]:
    """docs/architecture.md's table of modules over MODULE_LINES, with the most lines it allows each."""
    rows = re.findall(r"^\| `([\w/]+\.py)` \| (\d+) \| ", DOC.read_text(), re.MULTILINE)
    return {name: int(lines) for name, lines in rows}


def test_every_module_over_400_lines_is_named_with_its_reason_and_no_function_is_over_80() -> None:
    longer = {}
    functions = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            longer[name] = lines
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if (length := node.end_lineno - node.lineno + 1) > FUNCTION_LINES:
                    functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    stated = _longer_modules_in_the_doc()
    assert sorted(longer) == sorted(stated), "docs/architecture.md's longer modules"
    assert {n: lines for n, lines in longer.items() if lines > stated[n]} == {}, "over the lines the doc allows them"
    assert functions == []


# -- one writer of a request's story ------------------------------------------------------------------

# The one module that builds a route line from what a request's steps returned, and the one that reads
# a line back off the admin socket to render it (`onebitctl watch`).
LINE_BUILDERS = {"routes/story.py", "admin/render.py"}


def test_a_route_line_is_frozen_and_built_by_one_module() -> None:
    from supervisor.routeline import RouteLine

    line = RouteLine(req="1-1", endpoint="/completion")
    with pytest.raises(AttributeError):
        line.route = "file"  # type: ignore[misc]
    builders = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called == "RouteLine":
                    builders.add(str(path.relative_to(PACKAGE)))
    assert builders == LINE_BUILDERS


# -- the repository's other packages: bench/, chaos/, tools/ and tests/ ---------------------------------

ROOT = PACKAGE.parent
# Each package of the repository, with the packages it may import: supervisor/ and tools/ none of the
# others, the benchmarks and the chaos suite only onebit, the tests all of them.
PACKAGES = {
    "supervisor": set(),
    "tools": set(),
    "bench": {"supervisor"},
    "chaos": {"supervisor"},
    "tests": {"supervisor", "tools", "bench", "chaos"},
}
REPOSITORY = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for package in PACKAGES
    for path in sorted((ROOT / package).rglob("*.py"))
}
EVERY_GRAPH = {name: imported(name, path, REPOSITORY) for name, path in REPOSITORY.items()}
# The layers within bench/ and chaos/, lowest first: a module imports only modules of lower layers.  A
# module not named here is one benchmark, or one kind of chaos scenario, at BENCHMARK: it imports the
# rig, the workloads and the plotting, never another benchmark.
WINGS = {
    "bench": {"__init__": 0, "plot": 0, "trace": 0, "rig": 1, "workloads": 2, "cli": 4, "__main__": 5},
    "chaos": {"__init__": 0, "traffic": 0, "fuzz": 0, "rig": 1, "faults": 2, "cli": 4, "__main__": 5},
}
BENCHMARK = 3


def wing_layer(name: str) -> int:
    package, _, module = name.partition(".")
    return WINGS[package].get(module or "__init__", BENCHMARK)


def test_the_repository_graph_is_read_from_every_package() -> None:
    assert "bench.rig" in EVERY_GRAPH["bench.workloads"]
    assert "chaos.fuzz" in EVERY_GRAPH["chaos.clients"]  # imported in a function: hypothesis only when it runs
    assert "tests.rigs.rig" in EVERY_GRAPH["tests.conftest"]  # from .rig import ...
    assert "bench.cli" in EVERY_GRAPH["tests.unit.bench.test_bench"]


def test_no_import_anywhere_in_the_repository_runs_in_a_circle() -> None:
    assert a_cycle(EVERY_GRAPH) is None, " -> ".join(a_cycle(EVERY_GRAPH) or [])


def test_each_package_imports_only_the_packages_below_it() -> None:
    across = [
        f"{name} imports {other}"
        for name in sorted(EVERY_GRAPH)
        for other in sorted(EVERY_GRAPH[name])
        if other.split(".")[0] != name.split(".")[0] and other.split(".")[0] not in PACKAGES[name.split(".")[0]]
    ]
    assert across == []


@pytest.mark.parametrize("name", sorted(name for name in REPOSITORY if name.split(".")[0] in WINGS))
def test_every_benchmark_and_chaos_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_bench_and_chaos_import_only_down_their_layers_and_no_benchmark_another() -> None:
    upward = [
        f"{name} ({wing_layer(name)}) imports {other} ({wing_layer(other)})"
        for name in sorted(EVERY_GRAPH)
        if name.split(".")[0] in WINGS
        for other in sorted(EVERY_GRAPH[name])
        if other.split(".")[0] == name.split(".")[0] and wing_layer(other) >= wing_layer(name)
    ]
    assert upward == []


def test_no_module_puts_a_folder_on_sys_path_and_every_import_is_at_the_top() -> None:
    # Each package is imported as one (``python -m bench``, ``import bench.cli``), from the checkout.
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in REPOSITORY.values()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)\(|noqa: E40[2]", line)
    ]
    assert found == []
    assert sorted(str(path.relative_to(ROOT)) for path in (ROOT / "scripts").glob("*.py")) == []  # entry points only


def test_scripts_holds_entry_points_of_at_most_30_lines() -> None:
    """What a user runs is in scripts/; what it runs (set-up, the build, the benchmarks) lives in
    tools/ and the packages."""
    long = {path.name: n for path in (ROOT / "scripts").iterdir() if (n := len(path.read_text().splitlines())) > 30}
    assert long == {}
