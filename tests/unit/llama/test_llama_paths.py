"""llama-server's API is spelled in one module: supervisor/llama/decoder.py, the llama-server client.

Every string in supervisor/'s source that begins with one of llama-server's own paths (a plain
literal, or the first part of an f-string) is looked for, docstrings aside.  Two modules may spell
them besides the client: supervisor/llama/share_worker.py, a process of its own that speaks to its
llama-server with the standard library, and supervisor/api/endpoints.py, whose table names the paths
the front serves to its clients (the llama-server face) and those the relay forwards them to, as is.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import supervisor

PACKAGE = Path(supervisor.__file__).parent
CLIENT = "llama/decoder.py"
ASIDE = {"llama/share_worker.py", "api/endpoints.py"}
# llama-server's paths that onebitd calls (``/completions``, ``/v1/health``: other words).
PATH = re.compile(r"/(slots|completion|tokenize|detokenize|apply-template|props|metrics|health|v1/stream)(?![\w-])")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes: a module's, a class's, a function's first string statement."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled(source: str, filename: str = "<source>") -> list[str]:
    """``line: literal`` for every string in ``source`` that begins with a llama-server path."""
    tree = ast.parse(source, filename)
    skip = _docstrings(tree)
    inside_fstring: set[int] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inside_fstring.update(id(part) for part in node.values)
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str) and PATH.match(head.value):
                found.append(f"{node.lineno}: {head.value}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in skip or id(node) in inside_fstring:
                continue
            if PATH.match(node.value):
                found.append(f"{node.lineno}: {node.value}")
    return found


def test_llama_servers_paths_are_spelled_in_its_client_only() -> None:
    outside = [
        f"{relative}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (relative := path.relative_to(PACKAGE).as_posix()) not in ASIDE | {CLIENT}
        for line in spelled(path.read_text(), str(path))
    ]
    assert outside == []


def test_the_client_spells_them() -> None:
    assert len(spelled((PACKAGE / CLIENT).read_text())) >= 10


@pytest.mark.parametrize(
    "source",
    [
        'await client.request("GET", "/props")',
        'await client.post_json("/tokenize", {"content": text})',
        'path = f"/slots/{slot}?action=save"',
        'await client.request("DELETE", f"/v1/stream?conv_id={conversation}")',
        'reply = await client.request("GET", "/metrics")',
    ],
)
def test_a_path_put_back_outside_the_client_is_found(source: str) -> None:
    assert spelled(source) != []


@pytest.mark.parametrize(
    "source",
    [
        '"""Asks ``POST /completion`` for one token."""',
        'def f():\n    """``GET /slots``: whether the slot is busy."""',
        'ROUTE = "/completions"',
        'HEALTH = "/v1/health"',
        'message = "no such endpoint: /metrics"',
        'path = f"/tmp/onebit-{uid}"',
    ],
)
def test_docstrings_and_other_words_are_not_paths(source: str) -> None:
    assert spelled(source) == []
