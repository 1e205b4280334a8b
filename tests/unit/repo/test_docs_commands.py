"""Every ``scripts/...`` command (and ``python -m bench...``) that README.md and docs/ name exists and takes the
arguments they give it.

Commands are read from the docs' code.  A line of a fenced block, up to its comment (``#``, or two
spaces before a description) or a shell operator, is a whole command line.  An inline span (which
may run over a line break) may name a command and leave out what it requires (``scripts/bench
versus``, even ``scripts/bench versus --tree``), but every word it does give must be one the command
takes.  ``[...]`` is optional (both forms are checked), ``<...>`` a placeholder.

Nothing is run.  The Python scripts' own parsers parse each command and stop there (a dry run:
:data:`DRY_RUN` makes ``parse_args`` raise once it has parsed, and takes no abbreviated option);
build-llama-server runs with ``--print-path`` (it builds nothing); the set-up scripts take the words
:data:`PLAIN` says.  A command that no table here knows fails: say how its arguments are checked,
not only that it exists.  Any other path under scripts/ that a doc names must exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from itertools import product
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A dry run imports a script (onebitd's modules with it) and parses a few argument lists: seconds;
# a minute is a script that does more than parse.
TIMEOUT_S = 60

# The Python entry points whose parser a dry run asks, by the name the docs give them: a wrapper
# under scripts/, with the module (``-m``) it runs, or a module the docs run themselves.
PARSED = {
    "scripts/bench": "bench",
    "scripts/chaos": "chaos",
    "scripts/soak": "chaos.soak",
    "scripts/slotdiff": "supervisor.llama.statediff",
    "bench.engines": "bench.engines",
}
# The set-up scripts, with how many words they take: scripts/run FILE (the config); scripts/test's
# words go to pytest (none is documented); and the options each takes (scripts/setup --tests: what
# only the tests use, too).
PLAIN = {"scripts/setup": 0, "scripts/test": 0, "scripts/run": 1}
PLAIN_OPTIONS = {"scripts/setup": {"--tests"}}
# Its own dry run: where the binary is or will be, building nothing.
BUILD = "scripts/build-llama-server"

DRY_RUN = r"""
import argparse, contextlib, importlib, io, json, sys

target, cases = sys.argv[1], json.loads(sys.argv[2])
lenient = False


class Parsed(Exception):
    pass


def strict(parser):
    # An option by its whole name (argparse takes any unique prefix); in a sentence, nothing is
    # required: what an inline span leaves out is no error, a word it gives still is one.
    parser.allow_abbrev = False
    for action in parser._actions:
        action.required = action.required and not lenient
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)


parse = argparse.ArgumentParser.parse_args


def parse_and_stop(self, args=None, namespace=None):
    strict(self)
    parse(self, args, namespace)
    raise Parsed


argparse.ArgumentParser.parse_args = parse_and_stop
module = importlib.import_module(target)
if hasattr(module, "__path__"):  # a package: `python -m` runs its __main__ (which runs main() only as __main__)
    module = importlib.import_module(target + ".__main__")
entry = module.main
results = []
for argv, lenient in cases:
    sys.argv = [target, *argv]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            entry()
            status = "main() returned: it did not parse with parse_args"
        except Parsed:
            status = 0
        except SystemExit as exc:  # argparse's usage error (2), or --help (0)
            status = exc.code
    results.append([status, err.getvalue().strip().splitlines()[-1:]])
print(json.dumps(results))
"""


@attrs.frozen
class Command:
    where: str  # file:line
    script: str  # scripts/NAME
    forms: tuple[tuple[str, ...], ...]  # the argument lists it stands for (optional parts both ways)
    inline: bool  # named in a sentence: what it requires may be left out

    def __str__(self) -> str:
        return f"{self.where}: {self.script} {' '.join(self.forms[0])}".rstrip()


_SCRIPT = re.compile(r"(?<![\w/.-])scripts/[\w.-]*\w")
# A module of this tree run as a program without a wrapper (``.venv/bin/python -m bench.engines``).
_MODULE = re.compile(r"(?<=python -m )(?:bench|chaos)(?:\.\w+)*")
_FENCE = re.compile(r"^\s*(```|~~~)")
_END = re.compile(r"\s#|\s{2,}|&&|\|\||[|;>]")  # a comment, a description column, a shell operator


def _forms(words: list[str]) -> tuple[tuple[str, ...], ...]:
    """``[--engine openvino] --print-path``: with the bracketed part and without."""
    parts: list[list[tuple[str, ...]]] = []
    optional: list[str] | None = None
    for word in words:
        if word.startswith("[") and optional is None:
            optional, word = [], word[1:]
        if optional is not None:
            closes = word.endswith("]")
            optional.append(word.rstrip("]"))
            if closes:
                parts.append([(), tuple(w for w in optional if w)])
                optional = None
            continue
        parts.append([(word,)])
    return tuple(tuple(w for piece in choice for w in piece) for choice in product(*parts))


def _commands_in(code: str, where: str, *, inline: bool) -> list[Command]:
    found = []
    code = re.sub(r"<[^>]*>", "X", code)
    for match in [*_SCRIPT.finditer(code), *_MODULE.finditer(code)]:
        rest = code[match.end() :]
        cut = _END.search(rest)
        words = rest[: cut.start() if cut else len(rest)].split()
        if inline and not words:
            continue  # a script's name in a sentence, not a command line (its path is checked below)
        found.append(Command(where, match.group(0), _forms(words), inline))
    return found


def documented_commands() -> list[Command]:
    commands = []
    for doc in DOCS:
        name = doc.relative_to(ROOT)
        lines = doc.read_text().splitlines()
        prose: list[tuple[int, str]] = []
        fenced = False
        for number, line in enumerate(lines, 1):
            if _FENCE.match(line):
                fenced = not fenced
            elif fenced:
                commands += _commands_in(line, f"{name}:{number}", inline=False)
            else:
                prose.append((number, line))
        text = "\n".join(line for _, line in prose)
        for span in re.finditer(r"`([^`]+)`", text):
            number = prose[text.count("\n", 0, span.start())][0]
            commands += _commands_in(span.group(1).replace("\n", " "), f"{name}:{number}", inline=True)
    return commands


def _attempts(command: Command, form: tuple[str, ...]) -> list[tuple[str, ...]]:
    """A span may name an option and not its value (``scripts/bench versus --tree``): either parses."""
    return [form, (*form, "1")] if command.inline and form and form[-1].startswith("--") else [form]


def _by_script() -> dict[str, list[Command]]:
    grouped: dict[str, list[Command]] = defaultdict(list)
    for command in documented_commands():
        grouped[command.script].append(command)
    return dict(grouped)


COMMANDS = _by_script()


def test_the_docs_name_the_commands_this_test_checks() -> None:
    # The reader finds them: a reader that found nothing would pass everything below.
    assert ("overhead", "--quick") in {form for c in COMMANDS["scripts/bench"] for form in c.forms}
    assert ("--print-path",) in {form for c in COMMANDS[BUILD] for form in c.forms}
    assert {"scripts/bench", "scripts/chaos", "scripts/setup", "scripts/run"} <= COMMANDS.keys()


def test_every_path_under_scripts_the_docs_name_exists() -> None:
    named = {(doc.relative_to(ROOT), m.group(0)) for doc in DOCS for m in _SCRIPT.finditer(doc.read_text())}
    missing = sorted(f"{doc}: {path}" for doc, path in named if not (ROOT / path).exists())
    assert missing == []


def test_every_command_the_docs_name_is_one_this_test_knows_how_to_check() -> None:
    known = PARSED.keys() | PLAIN.keys() | {BUILD}
    commands = {script for script in COMMANDS if not script.endswith(".patch")}
    assert sorted(commands - known) == []
    for script in {script for script in commands if script.startswith("scripts/")}:
        path = ROOT / script
        assert path.is_file(), script
        assert os.access(path, os.X_OK), f"{script} is not executable"


@pytest.mark.parametrize("script", sorted({s for s in PARSED if s in COMMANDS}))
def test_each_python_command_the_docs_name_parses_its_arguments(script: str) -> None:
    target = PARSED[script]
    if target != script:  # a wrapper: it must run what it is listed with
        assert f"-m {target}" in (ROOT / script).read_text(), f"{script} does not run -m {target}"
    commands = COMMANDS[script]
    cases = sorted({(attempt, c.inline) for c in commands for form in c.forms for attempt in _attempts(c, form)})
    done = subprocess.run(
        [sys.executable, "-c", DRY_RUN, target, json.dumps(cases)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # this tree, as the scripts' own sys.path has it
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    status = dict(zip(cases, json.loads(done.stdout.splitlines()[-1]), strict=True))
    refused = [
        f"{c}: {status[form, c.inline][1] or status[form, c.inline][0]}"
        for c in commands
        for form in c.forms
        if all(status[attempt, c.inline][0] != 0 for attempt in _attempts(c, form))
    ]
    assert refused == []


def test_build_llama_server_takes_the_arguments_the_docs_give_it() -> None:
    refused = []
    for command in COMMANDS[BUILD]:
        for form in command.forms:
            argv = [*form, "--print-path"] if "--print-path" not in form else list(form)
            done = subprocess.run(
                ["bash", str(ROOT / BUILD), *argv], capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
            if done.returncode != 0 or not done.stdout.strip().endswith("/bin/llama-server"):
                refused.append(f"{command}: {done.stderr.strip()}")
    assert refused == []


def test_the_set_up_scripts_are_given_only_the_words_they_take() -> None:
    refused = [
        str(command)
        for script, most in PLAIN.items()
        for command in COMMANDS.get(script, [])
        for form in command.forms
        if len([word for word in form if not word.startswith("-")]) > most
        or any(word.startswith("-") and word not in PLAIN_OPTIONS.get(script, set()) for word in form)
    ]
    assert refused == []
