"""onebitctl's machinery: the registry of its verbs, the lookup of onebitd's admin socket, one call
of an onebitd verb, and the command line built from the registry.

:data:`VERBS` holds every verb of the command line: a name (its words are nested subcommands, so
``"config show"`` is ``onebitctl config show``), the arguments it takes, and a handler whose
docstring is its help.  ``@verb`` declares one of onebitctl's own; an onebitd verb
(:data:`supervisor.admin.verbs.VERBS`) becomes one through :func:`daemon_verb`, shown as ``@shows``
declared (supervisor/admin/ctl.py holds the declarations).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import __version__
from ..config import locate
from ..errors import ConfigError, OnebitError
from . import verbs as admin

Handler = Callable[[argparse.Namespace], int]
# How a verb of onebitd's is shown: its result printed (the exit status returned), each event, a refusal.
ShowResult = Callable[[argparse.Namespace, Any], int]
ShowEvent = Callable[[argparse.Namespace, dict[str, Any]], None]
ShowRefusal = Callable[[argparse.Namespace, dict[str, Any]], int]


def _no_arguments(_parser: argparse.ArgumentParser) -> None:
    pass


@attrs.frozen
class Command:
    handler: Handler  # its docstring: first line the one-line help, the rest the verb's --help
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


VERBS: dict[str, Command] = {}


def verb(
    name: str, arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
) -> Callable[[Handler], Handler]:
    """Register the decorated handler as ``onebitctl NAME``."""

    def register(handler: Handler) -> Handler:
        if name in admin.VERBS:
            raise TypeError(f"{name!r} is onebitd's verb: onebitctl only says how it is shown (@shows)")
        if not inspect.getdoc(handler):
            raise TypeError(f"verb {name!r}: its handler needs a docstring (it is the help)")
        VERBS[name] = Command(handler, arguments)
        return handler

    return register


def config_option(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: not given here, it does not hide a --config given before the verb.
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="default: $ONEBIT_CONFIG, else " + locate.DEFAULT_CONFIG,
    )


# -- talking to onebitd ---------------------------------------------------------------------------


def admin_socket(args: argparse.Namespace) -> Path:
    """--socket PATH, else ``admin.sock`` in the runtime directory of the config onebitd reads.

    Only ``server.runtime_dir`` is read from that file, without onebitd's checks: a config the
    daemon would refuse (the one ``reload`` is about to report) still leads to the daemon.  The
    built-in default may be absent (the runtime directory is then the default one); a file named
    by --config or $ONEBIT_CONFIG must be there.
    """
    if args.socket:
        return Path(args.socket)
    named = args.config or os.environ.get("ONEBIT_CONFIG")
    path = Path(named or locate.DEFAULT_CONFIG)
    hint = "; --socket PATH reaches onebitd without it"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        if not named:
            return locate.runtime_dir("") / locate.ADMIN_SOCKET
        raise ConfigError([f"{path}: cannot read: {exc}{hint}"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}{hint}"]) from None
    try:
        server = tomllib.loads(text).get("server", {})
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}{hint}"]) from None
    configured = server.get("runtime_dir", "") if isinstance(server, dict) else ""
    if not isinstance(configured, str):
        raise ConfigError([f"{path}: server.runtime_dir: expected a string, got {configured!r}{hint}"])
    # The default directory is per instance, keyed on the port (supervisor/config/locate.py).
    port = server.get("port", locate.DEFAULT_PORT) if isinstance(server, dict) else locate.DEFAULT_PORT
    if not isinstance(port, int) or isinstance(port, bool):
        port = locate.DEFAULT_PORT
    return locate.runtime_dir(configured, port=port) / locate.ADMIN_SOCKET


def _run(async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``trio.run``, with Ctrl-C and a closed stdout raised as themselves.

    They reach us wrapped in a group by every nursery they passed through (trio-websocket's, the
    admin client's); the verbs, and ``main``, handle the exception itself.  A Ctrl-C wins over
    whatever else the group holds: it can land in trio-websocket's reader task, whose end then
    fails the call too (the connection closed under it), and the operator asked to stop.
    """
    try:
        return trio.run(async_fn, *args)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt() from None
        if group.split(BrokenPipeError)[1] is None:
            raise BrokenPipeError() from None
        raise


def refused(_args: argparse.Namespace, reply: dict[str, Any]) -> int:
    """onebitd's ``ok: false``: its error, then its lines, on stderr; exit 1."""
    print(f"onebitctl: {reply.get('error', 'refused')}", file=sys.stderr)
    for line in reply.get("lines", []):
        print(f"onebitctl: {line}", file=sys.stderr)
    return 1


def _print_result(_args: argparse.Namespace, result: Any) -> int:
    """onebitd's result as JSON (a verb onebitctl has no presentation for)."""
    print(json.dumps(result, sort_keys=True))
    return 0


@attrs.frozen
class Shown:
    """How onebitctl shows one of onebitd's verbs; :data:`supervisor.admin.verbs.VERBS` has the rest."""

    result: ShowResult  # its docstring: first line the one-line help, the rest the verb's --help
    options: Callable[[argparse.ArgumentParser], None] = _no_arguments  # onebitctl's own (--json)
    event: ShowEvent | None = None
    refused: ShowRefusal = refused
    interrupted: int | None = None  # the exit status of a Ctrl-C, when it is how the verb ends


SHOWN: dict[str, Shown] = {}


def shows(
    name: str,
    options: Callable[[argparse.ArgumentParser], None] = _no_arguments,
    *,
    event: ShowEvent | None = None,
    refused: ShowRefusal = refused,
    interrupted: int | None = None,
) -> Callable[[ShowResult], ShowResult]:
    """Register the decorated function as what ``onebitctl NAME`` prints of onebitd's result."""

    def register(result: ShowResult) -> ShowResult:
        if name not in admin.VERBS:
            raise TypeError(f"{name!r} is not one of onebitd's verbs (supervisor.admin.verbs.VERBS)")
        if not inspect.getdoc(result):
            raise TypeError(f"verb {name!r}: its presentation needs a docstring (it is the help)")
        SHOWN[name] = Shown(result, options, event, refused, interrupted)
        return result

    return register


def _daemon_options(parser: argparse.ArgumentParser) -> None:
    # Also accepted before the verb; SUPPRESS keeps an absent one from hiding that.
    parser.add_argument(
        "--socket", metavar="PATH", default=argparse.SUPPRESS, help="onebitd's admin socket (default: from the config)"
    )
    config_option(parser)


def json_option(what: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help=what)

    return add


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its ValueError is the usage error's message."""

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return typed


def daemon_verb(name: str, verb: admin.Verb) -> Command:
    """``onebitctl NAME``: onebitd's verb NAME with its arguments, shown as :data:`SHOWN` says."""
    shown = SHOWN.get(name) or Shown(_print_result)

    def arguments(parser: argparse.ArgumentParser) -> None:
        _daemon_options(parser)
        for argument in verb.arguments:
            if argument.positional:
                parser.add_argument(
                    argument.name, metavar=argument.metavar, type=_typed(argument.type), help=argument.help
                )
                continue
            parser.add_argument(
                f"--{argument.name}", metavar=argument.metavar, type=_typed(argument.type), help=argument.help
            )
        shown.options(parser)

    def handler(args: argparse.Namespace) -> int:
        params = {a.name: getattr(args, a.name) for a in verb.arguments if getattr(args, a.name) is not None}

        def on_event(event: dict[str, Any]) -> None:
            if shown.event is not None:
                shown.event(args, event)

        try:
            reply: dict[str, Any] = _run(admin.call, admin_socket(args), name, params, on_event)
        except KeyboardInterrupt:
            if shown.interrupted is None:
                raise
            return shown.interrupted
        if not reply["ok"]:
            return shown.refused(args, reply)
        return shown.result(args, reply["result"])

    if name in SHOWN:
        handler.__doc__ = inspect.getdoc(shown.result)
    else:
        handler.__doc__ = f"onebitd's verb; its answer printed as JSON.\n\n{inspect.getdoc(verb.handler) or ''}"
    return Command(handler, arguments)


# -- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onebitctl", description="control and inspect onebitd")
    parser.add_argument("--version", action="version", version=f"onebitctl {__version__}")
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help=f"onebitd's admin socket (default: {locate.ADMIN_SOCKET} in the config's runtime dir)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="onebitd's config (default: $ONEBIT_CONFIG, else " + locate.DEFAULT_CONFIG + ")",
    )
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


def run(argv: Sequence[str] | None = None) -> int:
    """The command line ``argv`` asks for, run: its exit status (the module docstring of ctl.py lists them)."""
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
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read our output stopped (onebitctl watch | head): so do we, quietly, and so does
        # the interpreter's last flush of stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
