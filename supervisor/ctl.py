"""onebitctl: the operator's command line.

    onebitctl config show [--config FILE]   the effective configuration, defaults filled in, as TOML
    onebitctl config check FILE             "FILE: ok", or its error lines

Verbs are the :data:`VERBS` registry: a name (its words are nested subcommands, so ``"config show"``
is ``onebitctl config show``), the arguments it takes, and a handler whose docstring is its help.
A verb that talks to onebitd goes through :func:`supervisor.admin.call` under the daemon's own name
for it.

Exit status: 0 done; 1 onebitd refused or could not be reached; 2 a usage or configuration error.
Errors go to stderr as ``onebitctl: <file>: <key.path>: <what>`` lines.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import tomli_w

from . import __version__
from . import config as configuration
from .errors import ConfigError, OnebitError

# onebitd's default too (daemon.DEFAULT_CONFIG; a test keeps them equal): importing the daemon here
# would load the whole server stack for a command that reads one file.
DEFAULT_CONFIG = "/etc/onebit/onebit.toml"

Handler = Callable[[argparse.Namespace], int]


def _no_arguments(_parser: argparse.ArgumentParser) -> None:
    pass


@attrs.frozen
class Verb:
    handler: Handler  # its docstring: first line the one-line help, the rest the verb's --help
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


VERBS: dict[str, Verb] = {}


def verb(
    name: str, arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
) -> Callable[[Handler], Handler]:
    """Register the decorated handler as ``onebitctl NAME``."""

    def register(handler: Handler) -> Handler:
        if not inspect.getdoc(handler):
            raise TypeError(f"verb {name!r}: its handler needs a docstring (it is the help)")
        VERBS[name] = Verb(handler, arguments)
        return handler

    return register


def default_config() -> str:
    """Where onebitd reads its config: $ONEBIT_CONFIG, else /etc/onebit/onebit.toml."""
    return os.environ.get("ONEBIT_CONFIG", DEFAULT_CONFIG)


# -- config -------------------------------------------------------------------------------------


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="default: $ONEBIT_CONFIG, else " + DEFAULT_CONFIG)


def _file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE")


@verb("config show", _config_option)
def config_show(args: argparse.Namespace) -> int:
    """Print the effective configuration, every default filled in, as TOML.

    The file is --config FILE, else $ONEBIT_CONFIG, else /etc/onebit/onebit.toml, as for onebitd.
    It must pass onebitd's checks; the output loads back into the same configuration.
    """
    path = args.config or default_config()
    config = configuration.load(path)
    document: dict[str, Any] = configuration.unstructure(config)
    sys.stdout.write(f"# {path}, with every default filled in\n\n{tomli_w.dumps(document)}")
    return 0


@verb("config check", _file_argument)
def config_check(args: argparse.Namespace) -> int:
    """Check FILE as onebitd would load it: "FILE: ok" and exit 0, or one line per problem and exit 2."""
    configuration.load(args.file)
    print(f"{args.file}: ok")
    return 0


# -- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onebitctl", description="control and inspect onebitd")
    parser.add_argument("--version", action="version", version=f"onebitctl {__version__}")
    groups: dict[tuple[str, ...], Any] = {(): parser.add_subparsers(metavar="VERB", required=True)}
    for name, entry in VERBS.items():
        words = tuple(name.split())
        for depth in range(1, len(words)):
            group = words[:depth]
            if group not in groups:
                sub = groups[group[:-1]].add_parser(group[-1], help=f"the {' '.join(group)} verbs")
                groups[group] = sub.add_subparsers(metavar="VERB", required=True)
        doc = inspect.getdoc(entry.handler) or ""
        leaf = groups[words[:-1]].add_parser(
            words[-1],
            help=doc.splitlines()[0],
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        entry.arguments(leaf)
        leaf.set_defaults(handler=entry.handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        for line in exc.lines:
            print(f"onebitctl: {line}", file=sys.stderr)
        return 2
    except OnebitError as exc:
        print(f"onebitctl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
