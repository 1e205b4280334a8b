"""onebitctl: the operator's command line.

    onebitctl status [--json]               what onebitd is doing, as a table (or its statistics as JSON)
    onebitctl drain [--timeout S]           refuse new requests, wait for those in flight
    onebitctl resume                        undo a drain
    onebitctl watch [--json]                the route lines, live
    onebitctl reload                        re-read the config file
    onebitctl load MODEL                    load a model now (unloading idle ones in its way)
    onebitctl unload MODEL                  unload a model once the requests holding it are done
    onebitctl logs CHILD [--lines N]        a child's last lines of output, whatever level they were logged at
    onebitctl config show [--config FILE]   the effective configuration, defaults filled in, as TOML
    onebitctl config check FILE             "FILE: ok", or its error lines

Here are the verbs as onebitctl declares them: its own (``@verb``: config show, config check) and
how each verb of onebitd's table is shown (``@shows``: its help, events, result and refusal); the
registry, the admin socket's lookup and the command line are supervisor/admin/cli.py's, the text a
person reads supervisor/admin/render.py's.  The verbs that talk to onebitd are not declared here:
they are onebitd's own table, :data:`supervisor.admin.verbs.VERBS` (name, arguments), each run
through :func:`supervisor.admin.verbs.call` on ``--socket PATH`` or else the admin socket in the
runtime directory of onebitd's config.

Exit status: 0 done; 1 onebitd refused or could not be reached; 2 a usage or configuration error;
130 interrupted (Ctrl-C; ``watch`` ends that way with 0).  Errors go to stderr as
``onebitctl: <file>: <key.path>: <what>`` lines.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import tomli_w

from .. import config as configuration
from ..config import locate
from ..observe.status import from_wire
from . import cli, render
from . import verbs as admin
from .cli import SHOWN, VERBS, config_option, daemon_verb, json_option, refused, shows, verb

__all__ = ["SHOWN", "VERBS", "daemon_verb", "main", "shows", "verb"]


# -- config ---------------------------------------------------------------------------------------


def _file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE")


@verb("config show", config_option)
def config_show(args: argparse.Namespace) -> int:
    """Print the effective configuration, every default filled in, as TOML.

    The file is --config FILE, else $ONEBIT_CONFIG, else /etc/onebit/onebit.toml, as for onebitd.
    It must pass onebitd's checks; the output loads back into the same configuration.
    """
    path = args.config or locate.config_file()
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


# -- status ---------------------------------------------------------------------------------------


@shows("status", json_option("the raw statistics object, for scripts"))
def status(args: argparse.Namespace, result: Any) -> int:
    """Show what onebitd is doing: its state, children, providers, slots, requests, first-byte times.

    The table is for people.  --json prints onebitd's statistics object (sorted keys) for scripts;
    supervisor/admin/verbs.py's status verb documents it.  Answers in every daemon state.
    """
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        sys.stdout.write(render.render_status(from_wire(result)))
    return 0


# -- drain and resume -----------------------------------------------------------------------------


def _progress(_args: argparse.Namespace, event: dict[str, Any]) -> None:
    if event.get("event") == "progress":
        print(f"draining: {event['inflight']} in flight", flush=True)


def _still_in_flight(args: argparse.Namespace, reply: dict[str, Any]) -> int:
    refused(args, reply)
    for request in reply.get("remaining", []):
        print(
            f"onebitctl: in flight: req={request['req']} route={request['route']} "
            f"endpoint={request['endpoint']} age={render.age(request['age_s'])}",
            file=sys.stderr,
        )
    return 1


@shows("drain", event=_progress, refused=_still_in_flight)
def drain(args: argparse.Namespace, result: Any) -> int:
    """Refuse new requests (503, /health says draining) and wait for those in flight to finish.

    Prints "draining: N in flight" as the number changes, then how many slots it saved into the
    prefix store for another host or a restart (when any), then "drained", and exits 0.  With
    --timeout S it gives up after S seconds: exit 1, naming each request still in flight.  The
    daemon stays draining either way, until "onebitctl resume" (or a restart).
    """
    kept = result.get("kept") if isinstance(result, dict) else None
    if kept:
        print(f"kept {kept} slot(s) in the prefix store")
    print("drained")
    return 0


@shows("resume")
def resume(args: argparse.Namespace, result: Any) -> int:
    """Undo a drain: take new requests again.  Prints "resumed"."""
    print("resumed")
    return 0


# -- watch ----------------------------------------------------------------------------------------


def _line(args: argparse.Namespace, event: dict[str, Any]) -> None:
    if event.get("event") == "line":
        fields = event["line"]
        print(json.dumps(fields, separators=(",", ":")) if args.json else render.route_logfmt(fields), flush=True)


# Ctrl-C is how a watch ends: exit 0.
@shows("watch", json_option("one JSON object per line"), event=_line, interrupted=0)
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


# -- a child's output ----------------------------------------------------------------------------


@shows("logs", json_option("onebitd's answer as JSON"))
def logs(args: argparse.Namespace, result: Any) -> int:
    """Print a child's last lines of output (llama-server's), oldest first, each after the time
    onebitd read it.

    onebitd keeps each child's last 500 lines whatever log.children and log.level let into its log:
    the lines of a model's load, the requests after it, what it said before it died.  CHILD is a name
    "onebitctl status" lists (decoder, provider-NAME); --lines N prints only the last N.
    """
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    for heard in result["lines"]:
        print(f"{render.stamp(heard['at'])} {heard['line']}")
    return 0


# -- the prefix store -----------------------------------------------------------------------------


@shows("cache list", json_option("the entries and the store's statistics as JSON"))
def cache_list(args: argparse.Namespace, result: Any) -> int:
    """List the prefix store's entries, most recently used first: key, tokens, size, age.

    --json prints onebitd's answer (the entries and the store's statistics) for scripts.
    """
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    now = time.time()
    rows = [
        (
            e["key"][:16],
            e["n_tokens"],
            render.mib(e["state_bytes"]),
            render.age(now - e["created"]),
            render.age(now - e["last_used"]),
        )
        for e in result["entries"]
    ]
    if rows:
        print("\n".join(render.table(("ENTRY", "TOKENS", "SIZE", "MADE", "USED"), rows)))
    else:
        print("no entries")
    return 0


@shows("cache clear")
def cache_clear(args: argparse.Namespace, result: Any) -> int:
    """Remove every prefix store entry not in use.  Prints "removed N"."""
    print(f"removed {result['removed']}")
    return 0


# Every verb of onebitd's table, after onebitctl's own, in the table's order.
VERBS.update({name: daemon_verb(name, entry) for name, entry in admin.VERBS.items()})


def main(argv: Sequence[str] | None = None) -> int:
    """onebitctl: exit 0 done, 1 refused or unreachable, 2 a usage or config error, 130 Ctrl-C.

    SIGINT is how an operator ends a verb (``watch`` ends that way with 0), so it is honoured even
    where onebitctl inherited it ignored: a non-interactive shell starts its background jobs so, and
    Python and trio then leave it ignored, and ``watch`` would never end."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli.run(argv)


if __name__ == "__main__":
    sys.exit(main())
