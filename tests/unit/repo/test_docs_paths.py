"""Every module of onebitd's, bench/'s, chaos/'s and tools/', and every test file, that README.md and
docs/ name exists where they say it is, and every picture they show (``![...](plots/overhead.svg)``) is
there.

A doc names a module three ways: a path (``supervisor/http/server.py``), a path under one of
supervisor/'s folders with the ``supervisor/`` left out (docs/architecture.md's tree and tables say
their paths are under supervisor/: ``routes/completion.py``), and a dotted name
(``supervisor.llama.decoder.unix_transport``: the modules' part must resolve; what follows it is an
attribute, not looked for).  docs/architecture.md's module table names its modules bare
(``daemon.py``) in its first column; those must be under supervisor/ too.

The section ``## How it got here`` (docs/benchmarks.md's measurement history) is left out: it tells
what the code was, under the names it had then.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]
PACKAGE = ROOT / "supervisor"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = "## How it got here"

FOLDERS = sorted(path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file())
# A path not inside a longer one (``tests/routes/x.py`` is not supervisor's): no word, slash or dot before it.
# The repository's other packages are named by their paths too (``bench/rig.py``).
PATH = re.compile(r"(?<![\w/.])(?:supervisor|bench|chaos|tools)/(?:\w+/)*\w+\.py\b")
UNDER = re.compile(rf"(?<![\w/.])(?:{'|'.join(FOLDERS)})/(?:\w+/)*\w+\.py\b")
DOTTED = re.compile(r"(?<![\w/.])supervisor(?:\.\w+)+")
# The tests they name (``tests/unit/routes/test_routes.py``), which move between rooms.
TESTS = re.compile(r"(?<![\w/.])tests/(?:\w+/)*\w+\.py\b")
MODULE_ROW = re.compile(r"^\| (`[^|]*`) \|")


def without_history(text: str) -> str:
    """The text less its ``## How it got here`` section (to the next second-level heading or the end)."""
    start = text.find(f"\n{HISTORY}\n")
    if start < 0:
        return text
    end = text.find("\n## ", start + 1 + len(HISTORY))
    return text[:start] + ("" if end < 0 else text[end:])


def dotted_resolves(name: str) -> bool:
    """``supervisor.a.b.attr``: each part a package until one is a module (the rest its attributes)."""
    here = ROOT
    for part in name.split("."):
        if not (here / part / "__init__.py").is_file():
            return (here / f"{part}.py").is_file()
        here = here / part
    return True  # a package named whole


def module_table(text: str) -> list[str]:
    """The paths in the first column of docs/architecture.md's module table (under supervisor/)."""
    start = text.find("\n## Modules\n")
    if start < 0:
        return []
    end = text.find("\n## ", start + 1)
    section = text[start : None if end < 0 else end]
    paths = []
    for line in section.splitlines():
        row = MODULE_ROW.match(line)
        if row is not None:
            paths += re.findall(r"`([\w/]+\.py)`", row.group(1))
    return paths


def named(doc: Path) -> list[tuple[int, str, Path | None]]:
    """What ``doc`` names, outside its history: (line, as written, the file it must be or None for dotted)."""
    text = without_history(doc.read_text())
    found: list[tuple[int, str, Path | None]] = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [(number, match, ROOT / match) for match in PATH.findall(line)]
        found += [(number, match, PACKAGE / match) for match in UNDER.findall(line)]
        found += [(number, match, None) for match in DOTTED.findall(line)]
        found += [(number, match, ROOT / match) for match in TESTS.findall(line)]
    if doc.name == "architecture.md":
        found += [(0, f"the module table's {path}", PACKAGE / path) for path in module_table(text)]
    return found


def missing(doc: Path) -> list[str]:
    """``doc:line: name`` for each module ``doc`` names that is not there."""
    return [
        f"{doc.name}:{number}: {written}"
        for number, written, path in named(doc)
        if not (dotted_resolves(written) if path is None else path.is_file())
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    assert missing(doc) == []


def test_the_docs_name_modules_at_all() -> None:
    """The patterns find what the docs name (a pattern that matched nothing would pass every doc)."""
    kinds = {"path": 0, "under": 0, "dotted": 0, "table": 0}
    for doc in DOCS:
        for _, written, path in named(doc):
            if path is None:
                kinds["dotted"] += 1
            elif written.startswith("the module table's"):
                kinds["table"] += 1
            elif PATH.fullmatch(written):
                kinds["path"] += 1
            else:
                kinds["under"] += 1
    assert all(count > 0 for count in kinds.values()), kinds


@pytest.mark.parametrize(
    "text",
    [
        "The front is `supervisor/front.py`.",
        "see supervisor/http/nowhere.py, which",
        "| `api/nowhere.py` | a row |",
        "`supervisor.api.nowhere.Front`",
        "`supervisor.nowhere`",
        "tests/test_routes.py, where the route tests were before they had rooms",
    ],
)
def test_a_moved_module_put_back_in_a_doc_fails(tmp_path: Path, text: str) -> None:
    doc = tmp_path / "architecture.md"
    doc.write_text(f"# Doc\n\n## Modules\n\n| module | noun |\n|---|---|\n{text}\n")
    assert missing(doc) != []


@pytest.mark.parametrize(
    "text",
    [
        "`supervisor/http/server.py` and `supervisor.llama.decoder.unix_transport`",
        "`routes/completion.py`; tests/unit/routes/test_routes.py is not supervisor's",
        f"\n{HISTORY}\n\nonce `supervisor/connection.py`, gone with hypercorn\n",
    ],
)
def test_what_exists_or_is_history_passes(tmp_path: Path, text: str) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Doc\n\n{text}\n")
    assert missing(doc) == []


# A Markdown image: ``![what it shows](path)``, the path relative to the doc.
PICTURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def missing_pictures(doc: Path) -> list[str]:
    """``doc:line: path`` for each picture ``doc`` shows that is not there (docs/plots/*.svg, the
    screenshots): a figure renamed or never committed shows as a broken image, not as an error."""
    return [
        f"{doc.name}:{number}: {path}"
        for number, line in enumerate(doc.read_text().splitlines(), 1)
        for path in PICTURE.findall(line)
        if not path.startswith(("http://", "https://")) and not (doc.parent / path).is_file()
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_picture_a_doc_shows_is_there(doc: Path) -> None:
    assert missing_pictures(doc) == []


def test_a_picture_that_is_not_there_fails_and_one_that_is_passes(tmp_path: Path) -> None:
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "here.svg").write_text("<svg/>")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Doc\n\n![the figures](plots/here.svg)\n\n![gone](plots/gone.svg)\n")
    assert missing_pictures(doc) == ["benchmarks.md:5: plots/gone.svg"]
