"""The fake llama-server as a program, for what only a process shows (crashes, restarts, signals, fd
passing): the core (tests/fakes/llama/core.py) behind an HTTP/1.1 server, one thread per connection.

It is started exactly like llama-server (tests/rigs/rig.py's ``fake_llama_server`` writes the launcher set
as ``decoder.binary``: ``python -m tests.fakes.llama.process``), takes the arguments onebitd passes
(``-m -c -np -b -ub -ctk -ctv --host --port --slot-save-path --alias --no-webui -t``), ignores any
other, and listens on the unix socket given by ``--host`` (a host ending in ``.sock``, as llama-server
does) or on TCP otherwise.  It is the share route's fork: ``?action=share`` and ``adopt`` work.

Its modes are read from the ``decoder`` section of the control file (tests/fakes/fake_control.py:
``FAKE_CONTROL`` names it, tests write it with ``Control.set(decoder=Modes(...))``) whenever a mode
matters, so a test can change the behaviour of a running fake or between restarts; a pause polls them
(and gives up when the client leaves).  ``exit``/``exit_starts`` and ``ignore_sigterm`` are this
program's: starts are counted in ``<control file>.starts``.

The log, ``decoder.log`` beside the control file (none without one), has one JSON line per record of
the core and per start, with this process's pid.  A completion's::

    {"event": "completion", "pid": 4242, "seq": 3, "path": "/v1/chat/completions",
     "id_slot": 1, "slot": 1, "slot_busy": false, "stream": true, "prompt": "...",
     "n_predict": 8, "sent": 8, "finished": true, "disconnected": false, "cache_n": 0, "prompt_n": 9}

``seq`` numbers requests in the order they arrived; ``id_slot`` is what the body asked for (null when
absent), ``slot`` the one used; ``slot_busy`` says another request was in flight on that slot when this
one arrived (llama-server would have made it wait: a client that pins slots must never cause it);
``disconnected`` says the client closed the connection before the reply ended.  A start writes
``{"event": "start", "pid": ..., "argv": [...]}``; a completion also writes ``{"event": "arrived", "seq",
"id_slot", "slot", ...}`` as soon as it has its slot, so a test can see which requests are in flight where.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import socketserver
import sys
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.fakes import fake_control

from .core import Core, Modes, Settings
from .steps import After, Answer, Chunk, Head, Pause, Sleep, Whole

POLL_S = 0.01  # how often a held or hung request looks at its client and at the control file


def modes() -> Modes:
    """The ``decoder`` section of the control file, read again each time the modes are asked for."""
    return fake_control.modes("decoder", Modes)


@dataclass
class Args:
    model: str = ""
    ctx_size: int = 4096
    parallel: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str = ""
    slot_save_path: str = ""
    argv: list[str] = field(default_factory=list)


# The options we use, by every spelling llama-server accepts; any other argument is skipped.  argparse
# will not do: it reads llama-server's "-ctk f16" as "-c tk".
OPTIONS = {
    "-m": "model",
    "--model": "model",
    "-c": "ctx_size",
    "--ctx-size": "ctx_size",
    "-np": "parallel",
    "--parallel": "parallel",
    "--host": "host",
    "--port": "port",
    "-a": "alias",
    "--alias": "alias",
    "--slot-save-path": "slot_save_path",
}


def parse_args(argv: list[str]) -> Args:
    args = Args(argv=list(argv))
    words = iter(argv)
    for arg in words:
        name, eq, inline = arg.partition("=")
        key = OPTIONS.get(name if eq else arg)
        if key is None:
            continue
        value = inline if eq else next(words, "")
        setattr(args, key, int(value) if key in ("ctx_size", "parallel", "port") else value)
    args.parallel = max(1, args.parallel)
    return args


def settings(args: Args) -> Settings:
    alias = args.alias or Path(args.model).stem or "model"
    return Settings(
        args.parallel,
        args.ctx_size // args.parallel,
        alias,
        args.model,
        args.slot_save_path,
        kvshare=True,
        token_prompts=False,
    )


class ClientGone(Exception):
    """The client closed the connection while we were answering."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llama.cpp"
    core: Core  # set on the subclass made in main()

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        pass  # onebitd logs our output: one line per health check would drown it

    def do_GET(self) -> None:
        self.answer("GET")

    def do_POST(self) -> None:
        self.answer("POST")

    def do_DELETE(self) -> None:
        self.answer("DELETE")

    def answer(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        steps = self.core.answer(method, parts.path, query, self.read_body())
        try:
            self.drive(steps)
        except (ClientGone, OSError):  # OSError: the client left while we wrote
            steps.close()
            self.close_connection = True

    def drive(self, steps: Answer) -> None:
        streaming = False
        for step in steps:
            if isinstance(step, Whole):
                self.send_response(step.status)
                self.send_header("Content-Type", step.content_type)
                self.send_header("Content-Length", str(len(step.body)))
                self.end_headers()
                self.wfile.write(step.body)
                if step.close:  # as llama-server does after an error
                    self.close_connection = True
            elif isinstance(step, Head):
                self.send_response(step.status)
                self.send_header("Content-Type", step.content_type)
                self.send_header("X-Accel-Buffering", "no")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                streaming = True
            elif isinstance(step, Chunk):
                self.send_chunk(step.data)
            elif isinstance(step, Pause):
                while step.held():
                    if self.gone(POLL_S):
                        raise ClientGone()
            elif isinstance(step, Sleep):
                if self.gone(step.seconds):
                    raise ClientGone()
            elif isinstance(step, After):
                step.effect()
        if streaming:
            self.send_chunk(b"")

    def send_chunk(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError as exc:  # BrokenPipeError, ConnectionResetError
            raise ClientGone() from exc

    def read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def gone(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as the client has closed its end."""
        sock = self.connection
        deadline = time.monotonic() + seconds
        while True:
            left = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([sock], [], [], left)
            if readable:
                try:
                    peek = sock.recv(1, socket.MSG_PEEK)
                except OSError:
                    return True
                if not peek:
                    return True
                # A pipelined next request: not gone, and select would not block; just wait.
                time.sleep(left)
                return False
            if time.monotonic() >= deadline:
                return False


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # a held request must not keep a SIGTERMed fake alive
    block_on_close = False


def _count_start() -> int:
    """This start's number, 1 for the first; counted next to the control file."""
    control = fake_control.path()
    if control is None:
        return 1
    counter = control.with_name(control.name + ".starts")
    try:
        n = int(counter.read_text()) + 1
    except (OSError, ValueError):
        n = 1
    counter.write_text(str(n))
    return n


def main(argv: list[str]) -> int:
    if "--version" in argv:
        # As llama-server prints it (on stderr): onebitd reads it for the prefix store's fingerprint.
        print("version: 0 (fake)\nbuilt with the fake decoder for tests", file=sys.stderr)
        return 0
    args = parse_args(argv)
    now = modes()
    start = _count_start()
    log_path = fake_control.log_path("decoder")
    core = Core(settings(args), modes, lambda record: fake_control.append(log_path, record))
    core.log({"event": "start", "start": start, "argv": argv})
    if now.exit is not None and (now.exit_starts is None or start <= now.exit_starts):
        print(f"fake llama-server: exiting with status {now.exit} as told", flush=True)
        return now.exit
    if now.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))

    handler = type("BoundHandler", (Handler,), {"core": core})
    server: socketserver.BaseServer
    if args.host.endswith(".sock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.host)
        server = UnixHTTPServer(args.host, handler)
        where = args.host
    else:
        server = ThreadingHTTPServer((args.host, args.port), handler)
        where = f"http://{args.host}:{args.port}"
    print(f"fake llama-server: pid {os.getpid()} listening on {where} with {args.parallel} slots", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
        if args.host.endswith(".sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
