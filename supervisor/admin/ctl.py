"""onebitctl: the operator's command line.

    onebitctl status [--json]               what onebitd is doing, as a table (or its statistics as JSON)
    onebitctl drain [--timeout S]           refuse new requests, wait for those in flight
    onebitctl resume                        undo a drain
    onebitctl watch [--json]                the route lines, live
    onebitctl reload                        re-read the config file
    onebitctl load MODEL                    load a model now (unloading idle ones in its way)
    onebitctl unload MODEL                  unload a model once the requests holding it are done
    onebitctl config show [--config FILE]   the effective configuration, defaults filled in, as TOML
    onebitctl config check FILE             "FILE: ok", or its error lines

Verbs are the :data:`VERBS` registry: a name (its words are nested subcommands, so ``"config show"``
is ``onebitctl config show``), the arguments it takes, and a handler whose docstring is its help.
The verbs that talk to onebitd are not declared here: they are onebitd's own table,
:data:`supervisor.admin.verbs.VERBS` (name, arguments), each run through :func:`supervisor.admin.verbs.call` on
``--socket PATH`` or else the admin socket in the runtime directory of onebitd's config.  What is
onebitctl's own is how each one is shown (:func:`shows`: its help, events, result and refusal).

Exit status: 0 done; 1 onebitd refused or could not be reached; 2 a usage or configuration error;
130 interrupted (Ctrl-C; ``watch`` ends that way with 0).  Errors go to stderr as
``onebitctl: <file>: <key.path>: <what>`` lines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import tomli_w
import trio

from .. import __version__
from .. import config as configuration
from ..config import locate
from ..errors import ConfigError, OnebitError
from ..observe.status import DaemonStatistics, from_wire
from ..prefix.store import StoreStatistics
from ..routeline import RouteLine
from . import verbs as admin

# onebitd's default too (daemon.DEFAULT_CONFIG; a test keeps them equal): importing the daemon here
# would load the whole server stack for a command that reads one file.
DEFAULT_CONFIG = "/etc/onebit/onebit.toml"
# The name onebitd gives its admin socket in its runtime directory (Daemon.admin.path; a test keeps
# them equal).
ADMIN_SOCKET = "admin.sock"

Handler = Callable[[argparse.Namespace], int]
# How a verb of onebitd's is shown: its result printed (the exit status returned), each event, a refusal.
ShowResult = Callable[[argparse.Namespace, Any], int]
ShowEvent = Callable[[argparse.Namespace, dict[str, Any]], None]
ShowRefusal = Callable[[argparse.Namespace, dict[str, Any]], int]


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
        if name in admin.VERBS:
            raise TypeError(f"{name!r} is onebitd's verb: onebitctl only says how it is shown (@shows)")
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
    # SUPPRESS: not given here, it does not hide a --config given before the verb.
    parser.add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS, help="default: $ONEBIT_CONFIG, else " + DEFAULT_CONFIG
    )


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
    path = Path(named or DEFAULT_CONFIG)
    hint = "; --socket PATH reaches onebitd without it"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        if not named:
            return locate.runtime_dir("") / ADMIN_SOCKET
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
    return locate.runtime_dir(configured, port=port) / ADMIN_SOCKET


def _run(async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``trio.run``, with Ctrl-C and a closed stdout raised as themselves.

    They reach us wrapped in a group by every nursery they passed through (trio-websocket's, the
    admin client's); the verbs, and ``main``, handle the exception itself.
    """
    try:
        return trio.run(async_fn, *args)
    except BaseExceptionGroup as group:
        for kind in (KeyboardInterrupt, BrokenPipeError):
            if group.split(kind)[1] is None:
                raise kind() from None
        raise


def _refused(_args: argparse.Namespace, reply: dict[str, Any]) -> int:
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
    refused: ShowRefusal = _refused
    interrupted: int | None = None  # the exit status of a Ctrl-C, when it is how the verb ends


SHOWN: dict[str, Shown] = {}


def shows(
    name: str,
    options: Callable[[argparse.ArgumentParser], None] = _no_arguments,
    *,
    event: ShowEvent | None = None,
    refused: ShowRefusal = _refused,
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
    _config_option(parser)


def _json_option(what: str) -> Callable[[argparse.ArgumentParser], None]:
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


def _daemon_verb(name: str, verb: admin.Verb) -> Verb:
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
    return Verb(handler, arguments)


# -- status ---------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """A span a person reads at a glance, to its two largest units: 42s, 5m03s, 1h02m, 3d04h."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def age(seconds: float) -> str:
    """A request's age: tenths of a second while that still means something."""
    return f"{seconds:.1f}s" if seconds < 60 else duration(seconds)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(headers), *([_cell(value) for value in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip() for row in cells]


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))


def render_status(stats: DaemonStatistics) -> str:
    """The status table: what onebitd is doing, for a person."""
    daemon = stats.daemon
    lines = [f"onebitd {daemon.version}: {daemon.state}, pid {daemon.pid}, up {duration(daemon.uptime_s)}"]
    where = [f"config {daemon.config}"] if daemon.config else []
    where.append(f"runtime {daemon.runtime_dir}")
    if daemon.binds:
        where.append("listening on " + ", ".join(daemon.binds))
    lines += ["; ".join(where), ""]
    lines += _table(
        ("CHILD", "STATE", "PID", "RESTARTS", "LAST EXIT"),
        [(c.name, c.state, c.pid, c.restarts, c.last_exit) for c in stats.children],
    )
    lines.append("")
    several = stats.models is not None and len(stats.models.models) > 1
    if several:
        lines += _models_table(stats)
        lines += _models_providers(stats)
    elif stats.providers:
        lines += _table(
            ("PROVIDER", "KIND", "ENGINE", "DEVICE", "READY", "BUSY", "JOBS", "FAILURES"),
            [(p.name, p.kind, p.engine, p.device, p.ready, p.busy, p.jobs, p.failures) for p in stats.providers],
        )
        lines += [f"provider {p.name} refused: {p.refused}" for p in stats.providers if p.refused]
    else:
        lines.append("providers: none")
    slots = stats.slots
    if not several:  # several: each model's are its SLOTS column
        lines += [
            "",
            f"slots: {slots.busy} busy, {slots.free} free of {slots.total}; "
            f"queue: {slots.queued} waiting (limit {slots.queue_limit})",
        ]
    lines.append("")
    if stats.inflight:
        lines += _table(
            ("IN FLIGHT", "ROUTE", "ENDPOINT", "AGE"),
            [(r.req, r.route, r.endpoint, age(r.age_s)) for r in stats.inflight],
        )
    else:
        lines.append("in flight: none")
    requests = _counts(stats.routes) or "none yet"
    if stats.outcomes:
        requests += f" (outcomes: {_counts(stats.outcomes)})"
    if stats.restore_unused:
        requests += f"; restore unused {stats.restore_unused}"
    first = stats.first_byte
    if first.n and first.median_ms is not None and first.p95_ms is not None:
        over = f"the last {first.n} request{'s' if first.n != 1 else ''}"
        first_byte = f"median {first.median_ms:.1f} ms, p95 {first.p95_ms:.1f} ms over {over}"
    else:
        first_byte = "no requests yet"
    lines += [
        "",
        f"requests: {requests}",
        f"fallbacks: {_counts(stats.fallbacks) or 'none'}",
        f"first byte: {first_byte}",
    ]
    if several and stats.models is not None and any(m.store is not None for m in stats.models.models):
        lines += [f"prefix store {m.name}: {_store_line(m.store)}" for m in stats.models.models]
    else:
        lines.append(f"prefix store: {_store_line(stats.store)}")
    return "\n".join(lines) + "\n"


def _models_providers(stats: DaemonStatistics) -> list[str]:
    """Each model's providers (a provider several models name is on each of their rows: READY
    where it runs for that model now)."""
    assert stats.models is not None
    rows = [
        (m.name, p.name, p.kind, p.engine, p.device, p.ready, p.busy, p.jobs, p.failures)
        for m in stats.models.models
        for p in m.providers
    ]
    if not rows:
        return ["providers: none"]
    models = stats.models.models
    refused = [f"provider {p.name} ({m.name}) refused: {p.refused}" for m in models for p in m.providers if p.refused]
    return [
        *_table(("MODEL", "PROVIDER", "KIND", "ENGINE", "DEVICE", "READY", "BUSY", "JOBS", "FAILURES"), rows),
        *refused,
    ]


def _models_table(stats: DaemonStatistics) -> list[str]:
    models = stats.models
    assert models is not None
    rows = [
        (
            m.name + (" (default)" if m.default else ""),
            m.state,
            f"{m.memory_mib:.0f} MiB",
            m.users,
            f"{m.slots.busy}/{m.slots.total}" if m.slots is not None else None,
            m.loads,
            None if m.last_load_ms is None else f"{m.last_load_ms:.0f} ms",
            m.pin,
            f"{m.ttl_s:g}s" if m.ttl_s else None,
        )
        for m in models.models
    ]
    limits = [f"max_loaded {models.max_loaded or '-'}", f"budget {models.memory_budget_mib or '-'} MiB"]
    return [
        *_table(("MODEL", "STATE", "MEMORY", "USERS", "SLOTS", "LOADS", "LAST LOAD", "PIN", "TTL"), rows),
        f"models: {models.memory_mib:.0f} MiB resident; {', '.join(limits)}; "
        f"{models.swaps} swaps; {models.waiting} waiting for a load",
        "",
    ]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _store_line(store: StoreStatistics | None) -> str:
    if store is None:
        return "-"
    if not store.enabled:
        return "off"
    line = (
        f"{store.entries} entries, {_mib(store.bytes)} of {_mib(store.max_bytes)} in {store.directory}; "
        f"hits {store.hits}, misses {store.misses}, evictions {store.evictions}, restores {store.restores}"
    )
    if store.restore_ms_mean is not None:
        line += f" (mean {store.restore_ms_mean:.1f} ms)"
    return line


@shows("status", _json_option("the raw statistics object, for scripts"))
def status(args: argparse.Namespace, result: Any) -> int:
    """Show what onebitd is doing: its state, children, providers, slots, requests, first-byte times.

    The table is for people.  --json prints onebitd's statistics object (sorted keys) for scripts;
    supervisor/admin/verbs.py's status verb documents it.  Answers in every daemon state.
    """
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        sys.stdout.write(render_status(from_wire(result)))
    return 0


# -- drain and resume -----------------------------------------------------------------------------


def _progress(_args: argparse.Namespace, event: dict[str, Any]) -> None:
    if event.get("event") == "progress":
        print(f"draining: {event['inflight']} in flight", flush=True)


def _still_in_flight(args: argparse.Namespace, reply: dict[str, Any]) -> int:
    _refused(args, reply)
    for request in reply.get("remaining", []):
        print(
            f"onebitctl: in flight: req={request['req']} route={request['route']} "
            f"endpoint={request['endpoint']} age={age(request['age_s'])}",
            file=sys.stderr,
        )
    return 1


@shows("drain", event=_progress, refused=_still_in_flight)
def drain(args: argparse.Namespace, result: Any) -> int:
    """Refuse new requests (503, /health says draining) and wait for those in flight to finish.

    Prints "draining: N in flight" as the number changes, then "drained" and exits 0.  With
    --timeout S it gives up after S seconds: exit 1, naming each request still in flight.  The
    daemon stays draining either way, until "onebitctl resume" (or a restart).
    """
    print("drained")
    return 0


@shows("resume")
def resume(args: argparse.Namespace, result: Any) -> int:
    """Undo a drain: take new requests again.  Prints "resumed"."""
    print("resumed")
    return 0


# -- watch ----------------------------------------------------------------------------------------

_ROUTE_FIELDS = frozenset(a.name for a in attrs.fields(RouteLine))


def route_logfmt(fields: dict[str, Any]) -> str:
    """The route line as onebitd logs it (``-`` for what does not apply)."""
    # Fields a newer daemon added are left out rather than refused.
    return RouteLine(**{k: v for k, v in fields.items() if k in _ROUTE_FIELDS}).logfmt()


def _line(args: argparse.Namespace, event: dict[str, Any]) -> None:
    if event.get("event") == "line":
        fields = event["line"]
        print(json.dumps(fields, separators=(",", ":")) if args.json else route_logfmt(fields), flush=True)


# Ctrl-C is how a watch ends: exit 0.
@shows("watch", _json_option("one JSON object per line"), event=_line, interrupted=0)
def watch(args: argparse.Namespace, result: Any) -> int:
    """Print each request's route line as the request ends, until Ctrl-C or onebitd goes away.

    logfmt as onebitd logs it; --json: one JSON object per line (null for what does not apply).
    Ctrl-C ends it with exit 0; onebitd stopping ends it with exit 1.
    """
    return 0


# -- reload ---------------------------------------------------------------------------------------


@shows("reload")
def reload(args: argparse.Namespace, result: Any) -> int:
    """Have onebitd re-read its config file (as SIGHUP does).

    Prints the keys applied live and those that need a restart.  A file with errors is refused:
    onebitd's error and one line per problem, exit 1; the running config stays.
    """
    print(f"applied: {', '.join(result['applied']) or 'nothing'}")
    print(f"needs a restart: {', '.join(result['restart_needed']) or 'nothing'}")
    return 0


# -- models ---------------------------------------------------------------------------------------


@shows("load")
def load(args: argparse.Namespace, result: Any) -> int:
    """Load a model now, unloading the least recently used idle ones in its way.

    Prints "MODEL: loaded in N ms" once it is loaded; exit 1 when it failed or did not load within
    models.load_timeout_s.
    """
    if result["state"] != "loaded":
        print(f"onebitctl: {result['name']}: {result['state']}", file=sys.stderr)
        return 1
    print(f"{result['name']}: loaded in {result['last_load_ms'] or 0:.0f} ms")
    return 0


@shows("unload")
def unload(args: argparse.Namespace, result: Any) -> int:
    """Unload a model once the requests holding it are done (its slots' prompts kept in the prefix
    store first).  Prints "MODEL: unloaded"."""
    print(f"{result['name']}: {result['state']}")
    return 0


# -- the prefix store -----------------------------------------------------------------------------


@shows("cache list", _json_option("the entries and the store's statistics as JSON"))
def cache_list(args: argparse.Namespace, result: Any) -> int:
    """List the prefix store's entries, most recently used first: key, tokens, size, age.

    --json prints onebitd's answer (the entries and the store's statistics) for scripts.
    """
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    now = time.time()
    rows = [
        (e["key"][:16], e["n_tokens"], _mib(e["state_bytes"]), age(now - e["created"]), age(now - e["last_used"]))
        for e in result["entries"]
    ]
    if rows:
        print("\n".join(_table(("ENTRY", "TOKENS", "SIZE", "MADE", "USED"), rows)))
    else:
        print("no entries")
    return 0


@shows("cache clear")
def cache_clear(args: argparse.Namespace, result: Any) -> int:
    """Remove every prefix store entry not in use.  Prints "removed N"."""
    print(f"removed {result['removed']}")
    return 0


# Every verb of onebitd's table, after onebitctl's own, in the table's order.
VERBS.update({name: _daemon_verb(name, entry) for name, entry in admin.VERBS.items()})


# -- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onebitctl", description="control and inspect onebitd")
    parser.add_argument("--version", action="version", version=f"onebitctl {__version__}")
    parser.add_argument(
        "--socket", metavar="PATH", help=f"onebitd's admin socket (default: {ADMIN_SOCKET} in the config's runtime dir)"
    )
    parser.add_argument(
        "--config", metavar="FILE", help="onebitd's config (default: $ONEBIT_CONFIG, else " + DEFAULT_CONFIG + ")"
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
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read our output stopped (onebitctl watch | head): so do we, quietly, and so does
        # the interpreter's last flush of stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
