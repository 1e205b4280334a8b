"""A stand-in for llama-server, for fault injection.  Standard library only; one thread per connection.

It is started exactly like llama-server (``tests/conftest.py``'s ``fake_decoder_config`` wraps it in a
shell script set as ``decoder.binary``), takes the arguments onebitd passes (``-m -c -np -b -ub -ctk
-ctv --host --port --slot-save-path --alias --no-webui -t``), ignores any other, and listens on the unix
socket given by ``--host`` (a host ending in ``.sock``, as llama-server does) or on TCP otherwise.

Endpoints answer with llama-server's JSON shapes (checked against build 11434): ``GET /health``,
``/v1/models``, ``/models``, ``/props``, ``/slots``; ``POST /tokenize`` (one token per whitespace-separated
word, its id a stable hash), ``/detokenize``, ``/apply-template`` (ChatML), and the completions
``/completion``, ``/v1/completions`` and ``/v1/chat/completions``.  A completion's reply is its prompt's
words echoed (for chat, the last message's), ``n_predict``/``max_tokens`` of them (16 when unbounded),
with ``timings`` (``cache_n`` from the slot's cache, below) and ``usage`` where llama-server puts them.
``stream: true`` sends one ``data: {...}`` event per token, the last one with ``timings`` (a chat stream
asked for its usage, ``stream_options.include_usage``, ends with one more: no choices, the ``usage``
and the ``timings``); the OpenAI endpoints end with ``data: [DONE]``, llama.cpp's native
``/completion`` does not.  An invalid body gets
400 in llama-server's error shape ``{"error": {"code", "message", "type"}}``; while loading, every
endpoint but ``/health`` gets 503.

Fault modes: the fields of :class:`Modes`, read from the ``decoder`` section of the control file
(tests/fake_control.py: ``FAKE_CONTROL`` names it, tests write it with ``Control.set(decoder=Modes(...))``)
whenever a mode matters, so a test can change the behaviour of a running fake or between restarts.
tests/fake_llama.py, the in-process fake, takes the same :class:`Modes`.

    load_s                /health says "Loading model" (503) for this many seconds after start (default 0)
    loading               true: loading until the control file says otherwise
    exit                  exit with this status right after start (a crash)
    exit_starts           with ``exit``: only the first N starts exit; starts are counted in
                          ``<control file>.starts``
    unhealthy_after       after N health checks, /health answers 503 forever
    token_delay_s         seconds between streamed tokens (default 0)
    hang                  completions never answer (until the client leaves)
    hold                  true: a completion pauses after its first streamed token (a whole reply: before
                          answering) while this holds; a list of strings holds only the requests whose
                          prompt contains one of them
    ignore_sigterm        ignore SIGTERM, so only SIGKILL stops it
    hold_restore          true: a restore waits while this holds (logs ``restore-held`` once), giving up
                          if the client leaves
    restore_refuse        restores answer 400, as for a file saved elsewhere
    restore_wrong_n       a restore loads the file but answers one token short
    restore_unused        a restore answers success but leaves the slot as it was, so the next completion
                          re-evaluates the prompt (ggml-org/llama.cpp#26676)
    kvshare_refuse        ?action=share answers 400, as the NPU fork does for a hybrid model's cache
    kvshare_no_id         ?action=share answers 200 without a share_id
    kvshare_no_connect    ... answers a share_id but never connects
    kvshare_bad_header    ... sends a header with one fd fewer than regions
    kvshare_adopt_refuse  ?action=adopt answers 400 "Cannot adopt ..."
    kvshare_regions       how many regions a share lends (1 or 2, default 2)

The log, ``decoder.log`` beside the control file (none without one), has one JSON line per completion
request, per slot action, and per start.  A line for a completion, written when the request ends (when
it ends well: before the reply's last bytes leave, so a client holding the whole reply can count on the
line being there)::

    {"event": "completion", "pid": 4242, "seq": 3, "path": "/v1/chat/completions",
     "id_slot": 1, "slot": 1, "slot_busy": false, "stream": true, "prompt": "...",
     "n_predict": 8, "sent": 8, "finished": true, "disconnected": false}

``seq`` numbers requests in the order they arrived; ``id_slot`` is what the body asked for (null when
absent), ``slot`` the one used; ``slot_busy`` says another request was in flight on that slot when this
one arrived (llama-server would have made it wait: a client that pins slots must never cause it);
``disconnected`` says the client closed the connection before the reply ended.  A start writes
``{"event": "start", "pid": ..., "argv": [...]}``; a completion also writes ``{"event": "arrived", "seq",
"id_slot", "slot"}`` as soon as it has its slot, so a test can see which requests are in flight where.
Each slot action writes ``{"event": "<action>", "slot", ...}`` with what it did (``n_restored``,
``n_adopted``, ``refused``, ``disconnected``), and a held restore ``{"event": "restore-held"}``.

The slot cache.  Each slot holds the tokens of its KV cells.  A completion on a slot whose cells hold a
prefix of its prompt evaluates only the rest (``prompt_n`` = prompt - cached, at least 1, as llama-server
re-evaluates the last token for its logits; ``cache_n`` = cached), and its reply is the same as from an
empty slot.  Cells that came from a handoff (a restore or an adopt) are taken as the prompt's, for as
many positions as they cover, without comparing tokens: a handed-over state's token ids are only labels
on its KV, and KV computed for other tokens decodes to a wrong answer.  So when they hold other tokens
than the prompt's, the reply is derived from them (its first word ``stale-kv``), and a broken handoff
shows as a wrong answer, not only as a slow one.

Slot actions, ``POST /slots/<id>?action=...`` (a filename with a path separator is refused with 400
"Invalid filename", as llama-server's validation does):

    save     {"filename"}          writes {"fake_state": true, "tokens": [...]} into --slot-save-path
    restore  {"filename"}          reads such a file into the slot; 400 if it is missing or not one
    erase                          empties the slot
    share    {"socket", "n_tokens"}  lends the slot's KV (see docs/protocol.md): answers {"share_id"},
                                   connects to ``socket`` and sends a 4-byte big-endian length, the JSON
                                   header and, by SCM_RIGHTS, one memfd per region.  The layout: n_layer
                                   2, tensors cache_k_l<L> and cache_v_l<L>, row_bytes 16, align 4096,
                                   n_ctx the slot's context
    adopt    {"share_id", "n_tokens"}  reads the rows back: the slot then holds the tokens of the rows
                                   that are right (:func:`expected_row`) from position 0 up to the first
                                   wrong or missing one, so a short region makes the next completion
                                   evaluate the rest.  Logs ``n_adopted``

A lent region is the slot's own KV: until an adopt or an erase ends the share, rows written into it
have overwritten the slot's cells, and a completion that reuses those cells answers from the rows.

Extending: every endpoint is a function registered with ``@route(method, path)`` (``prefix=True`` to
match a path prefix, as ``/slots/<id>`` does); it gets an :class:`Exchange` and raises
:class:`HttpError` for an error reply.  Slot actions dispatch through ``SLOT_ACTIONS``.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import mmap
import os
import select
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING or __package__:  # imported by the tests (and so read by mypy)
    from . import fake_control
else:  # run as a program: Python put this folder first on sys.path
    import fake_control

N_VOCAB = 49152  # SmolLM2's vocabulary size, so token ids look plausible
DEFAULT_PREDICT = 16  # n_predict -1 (unbounded) would never end without an EOS token
PROMPT_MS_PER_TOKEN = 0.5
PREDICT_MS_PER_TOKEN = 1.0
POLL_S = 0.01  # how often a held or hung request looks at its client and at the control file


# -- modes ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Modes:
    load_s: float = 0.0
    loading: bool = False
    exit: int | None = None
    exit_starts: int | None = None
    unhealthy_after: int | None = None
    token_delay_s: float = 0.0
    hang: bool = False
    hold: bool | list[str] = False
    ignore_sigterm: bool = False
    hold_restore: bool = False
    restore_refuse: bool = False
    restore_wrong_n: bool = False
    restore_unused: bool = False
    # Recurrent memory (tests/fake_llama.py only): a slot's state cannot be cut back to an earlier
    # token, so a slot that holds all of a prompt, or more, evaluates it again from the start.
    recurrent: bool = False
    kvshare_refuse: bool = False
    kvshare_no_id: bool = False
    kvshare_no_connect: bool = False
    kvshare_bad_header: bool = False
    kvshare_adopt_refuse: bool = False
    kvshare_regions: int = 2


class ModeSource:
    """The ``decoder`` section of the control file, read again each time the modes are asked for."""

    def __init__(self) -> None:
        self.control = fake_control.path()

    def current(self) -> Modes:
        return fake_control.modes("decoder", Modes)


# -- the model, such as it is -----------------------------------------------------------------------


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % N_VOCAB


def expected_row(token: int, pos: int, tensor: str, row_bytes: int) -> bytes:
    """The bytes a provider writes for ``token`` at ``pos`` in ``tensor``: the token id, big-endian,
    then a hash of all three.  tests/fake_share_provider.py has the same function; they must agree."""
    seed = f"{tensor}:{pos}:{token}".encode()
    digest = b""
    while len(digest) < row_bytes - 4:
        digest += hashlib.sha256(seed + len(digest).to_bytes(4, "big")).digest()
    return token.to_bytes(4, "big") + digest[: row_bytes - 4]


def chatml(messages: Any, *, generation_prompt: bool = True) -> str:
    """The messages in ChatML; ``generation_prompt``: with the assistant turn's opening after them."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' is required")
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HttpError(400, "each message must be an object with a 'role'")
        parts.append(f"<|im_start|>{message['role']}\n{content_text(message.get('content'))}<|im_end|>\n")
    return "".join(parts) + ("<|im_start|>assistant\n" if generation_prompt else "")


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(str(t) for t in texts)
    raise HttpError(400, "'content' must be a string or an array of parts")


def timings(cache_n: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
    prompt_ms = prompt_n * PROMPT_MS_PER_TOKEN
    predicted_ms = predicted_n * PREDICT_MS_PER_TOKEN
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": PROMPT_MS_PER_TOKEN,
        "prompt_per_second": 1000 / PROMPT_MS_PER_TOKEN,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": PREDICT_MS_PER_TOKEN,
        "predicted_per_second": 1000 / PREDICT_MS_PER_TOKEN,
    }


# -- the server's state -----------------------------------------------------------------------------


@dataclass
class Settings:
    model: str = ""
    ctx_size: int = 4096
    parallel: int = 1
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str = ""
    slot_save_path: str = ""
    argv: list[str] = field(default_factory=list)


# The share layout: small, so a region is a few pages.  Alignment as llama.cpp's (4 KiB).
SHARE_LAYERS = 2
SHARE_ROW_BYTES = 16
SHARE_ALIGN = 4096


def _align(n: int) -> int:
    return -(-n // SHARE_ALIGN) * SHARE_ALIGN


class Share:
    """A slot's KV lent out: one memfd per region, mapped here so an adopt can read the rows back."""

    def __init__(self, share_id: str, slot: int, n_ctx: int, n_regions: int) -> None:
        self.share_id = share_id
        self.slot = slot
        self.n_ctx = n_ctx
        self.tensors: list[dict[str, Any]] = []
        tensor_size = _align(n_ctx * SHARE_ROW_BYTES)
        sizes = [0] * n_regions
        for layer in range(SHARE_LAYERS):
            for kind in ("k", "v"):
                region = 0 if n_regions == 1 or kind == "k" else 1
                self.tensors.append(
                    {
                        "name": f"cache_{kind}_l{layer}",
                        "region": region,
                        "offset": sizes[region],
                        "row_bytes": SHARE_ROW_BYTES,
                    }
                )
                sizes[region] += tensor_size
        self.header = {
            "share_id": share_id,
            "n_ctx": n_ctx,
            "n_layer": SHARE_LAYERS,
            "align": SHARE_ALIGN,
            "regions": [{"size": size} for size in sizes],
            "tensors": self.tensors,
        }
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        try:
            for i, size in enumerate(sizes):
                fd = os.memfd_create(f"fake-kv-{share_id}-{i}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, size)
                self.maps.append(mmap.mmap(fd, size))
        except BaseException:
            self.close()
            raise

    def written(self, pos: int) -> int | None:
        """What a provider wrote at ``pos``: its token (-1 for rows that are not a token's), or None."""
        rows = []
        for tensor in self.tensors:
            start = tensor["offset"] + pos * SHARE_ROW_BYTES
            rows.append(self.maps[tensor["region"]][start : start + SHARE_ROW_BYTES])
        if not any(any(row) for row in rows) or len(rows[0]) < SHARE_ROW_BYTES:
            return None
        token = int.from_bytes(rows[0][:4], "big")
        if all(
            row == expected_row(token, pos, t["name"], SHARE_ROW_BYTES)
            for row, t in zip(rows, self.tensors, strict=True)
        ):
            return token
        return -1

    def valid_tokens(self, n_tokens: int) -> list[int]:
        """The tokens whose rows are right in every tensor, from position 0 to the first that is not."""
        tokens: list[int] = []
        for pos in range(n_tokens):
            token = None
            for tensor in self.tensors:
                start = tensor["offset"] + pos * SHARE_ROW_BYTES
                row = self.maps[tensor["region"]][start : start + SHARE_ROW_BYTES]
                if len(row) < SHARE_ROW_BYTES:
                    return tokens
                if token is None:
                    token = int.from_bytes(row[:4], "big")
                if row != expected_row(token, pos, tensor["name"], SHARE_ROW_BYTES):
                    return tokens
            assert token is not None
            tokens.append(token)
        return tokens

    def close(self) -> None:
        for m in self.maps:
            m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []


@dataclass
class Claimed:
    """A completion's slot, as :meth:`Fake.claim` hands it out."""

    slot: int
    busy: bool
    seq: int
    cache_n: int
    stale: list[int] | None  # handed-over cells that hold other tokens than the prompt's


class Fake:
    """Everything the handler threads share; ``lock`` guards the mutable parts."""

    def __init__(self, settings: Settings, modes: ModeSource) -> None:
        self.settings = settings
        self.modes = modes
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.health_checks = 0
        self.seq = 0
        self.processing = [0] * settings.parallel  # requests in flight per slot
        self.cache: list[list[int]] = [[] for _ in range(settings.parallel)]  # each slot's KV, as tokens
        # The slot's cells came from a restore or an adopt: the next completion takes them as given.
        self.handed = [False] * settings.parallel
        self.shares: dict[str, Share] = {}
        self.share_seq = 0
        self.vocab: dict[int, str] = {}
        self.alias = settings.alias or Path(settings.model).stem or "model"
        self.log_path = fake_control.log_path("decoder")

    def loading(self) -> bool:
        modes = self.modes.current()
        return modes.loading or time.monotonic() - self.started < modes.load_s

    def tokenize(self, text: str) -> list[int]:
        ids = []
        with self.lock:
            for word in text.split():
                tid = token_id(word)
                self.vocab[tid] = word
                ids.append(tid)
        return ids

    def log(self, record: dict[str, Any]) -> None:
        fake_control.append(self.log_path, record)

    def claim(self, asked: Any, prompt: list[int]) -> Claimed:
        """Take a slot for a request, and see what its cache holds of the prompt."""
        with self.lock:
            self.seq += 1
            n = self.settings.parallel
            if isinstance(asked, int) and not isinstance(asked, bool) and 0 <= asked < n:
                slot = asked
            else:  # llama-server ignores an id_slot it does not have, as it does -1
                idle = [i for i in range(n) if not self.processing[i]]
                slot = idle[0] if idle else 0
            busy = self.processing[slot] > 0
            self.processing[slot] += 1
            cached = self.cache[slot]
            if self.handed[slot]:
                # A handed-over state is taken as the prompt's own: nothing compares its tokens.
                common = len(cached)
            else:
                common = 0
                for a, b in zip(cached, prompt, strict=False):
                    if a != b:
                        break
                    common += 1
            # llama-server evaluates at least the prompt's last token again, to get its logits.
            cache_n = max(0, min(common, len(prompt) - 1))
            content = self.content(slot)
            stale = content[:cache_n] if content[:cache_n] != prompt[:cache_n] else None
            return Claimed(slot, busy, self.seq, cache_n, stale)

    def content(self, slot: int) -> list[int]:
        """What the slot's cells really hold: a lent region is the slot's KV, so rows a provider wrote
        into a share that was neither adopted nor erased have overwritten the cells under their tokens."""
        content = list(self.cache[slot])
        for share in self.shares.values():
            if share.slot == slot:
                for pos in range(min(len(content), share.n_ctx)):
                    written = share.written(pos)
                    if written is not None:
                        content[pos] = written
        return content

    def release(self, slot: int, tokens: list[int]) -> None:
        with self.lock:
            self.processing[slot] -= 1
            self.cache[slot] = tokens
            self.handed[slot] = False

    def hand_over(self, slot: int, tokens: list[int]) -> None:
        with self.lock:
            self.cache[slot] = list(tokens)
            self.handed[slot] = True

    def erase(self, slot: int) -> int:
        with self.lock:
            n = len(self.cache[slot])
            self.cache[slot] = []
            self.handed[slot] = False
            dropped = [share for share in self.shares.values() if share.slot == slot]
            for share in dropped:
                del self.shares[share.share_id]
        for share in dropped:
            share.close()
        return n

    def word(self, token: int) -> str:
        with self.lock:
            return self.vocab.get(token, f"<{token}>")


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 501: "not_supported_error"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, type_: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ERROR_TYPES.get(status, "unavailable_error" if status == 503 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type}}


class ClientGone(Exception):
    """The client closed the connection while we were answering."""


# -- one request ------------------------------------------------------------------------------------


class Exchange:
    """One request and the means to answer it, as endpoint functions see it."""

    def __init__(self, handler: Handler, fake: Fake, method: str) -> None:
        self.handler = handler
        self.fake = fake
        self.method = method
        parts = urlsplit(handler.path)
        self.path = parts.path
        self.query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        self.raw = handler.read_body()
        self.replied = False

    def json(self) -> dict[str, Any]:
        try:
            data = json.loads(self.raw or b"{}")
        except ValueError as exc:
            raise HttpError(400, f"[json.exception.parse_error.101] parse error: {exc}") from None
        if not isinstance(data, dict):
            raise HttpError(400, "[json.exception.type_error.304] cannot use at() with array")
        return data

    def reply(self, status: int, data: Any) -> None:
        body = json.dumps(data, separators=(",", ":")).encode()
        h = self.handler
        h.send_response(status)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
        self.replied = True

    def start_stream(self) -> None:
        h = self.handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("X-Accel-Buffering", "no")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        self.replied = True

    def send_chunk(self, data: bytes) -> None:
        try:
            self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except OSError as exc:  # BrokenPipeError, ConnectionResetError
            raise ClientGone() from exc

    def send_event(self, data: Any) -> None:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        self.send_chunk(f"data: {text}\n\n".encode())

    def end_stream(self) -> None:
        self.send_chunk(b"")

    def gone(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as the client has closed its end."""
        sock = self.handler.connection
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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "llama.cpp"
    fake: Fake  # set on the subclass made in main()

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format: str, *args: Any) -> None:
        pass  # onebitd logs our output: one line per health check would drown it

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

    def do_GET(self) -> None:
        self.dispatch("GET")

    def do_POST(self) -> None:
        self.dispatch("POST")

    def do_DELETE(self) -> None:
        self.dispatch("DELETE")

    def dispatch(self, method: str) -> None:
        ex = Exchange(self, self.fake, method)
        try:
            endpoint = find_route(method, ex.path)
            if endpoint is None:
                raise HttpError(404, "File Not Found")
            if ex.path != "/health" and self.fake.loading():
                raise HttpError(503, "Loading model")
            endpoint(ex)
        except HttpError as exc:
            if not ex.replied:
                ex.reply(exc.status, exc.body())
                self.close_connection = True  # as llama-server does after an error
        except (ClientGone, OSError):  # OSError: the client left while we wrote
            self.close_connection = True


# -- endpoints --------------------------------------------------------------------------------------

Endpoint = Callable[[Exchange], None]
ROUTES: dict[tuple[str, str], Endpoint] = {}
PREFIX_ROUTES: list[tuple[str, str, Endpoint]] = []


def route(method: str, path: str, *, prefix: bool = False) -> Callable[[Endpoint], Endpoint]:
    def register(fn: Endpoint) -> Endpoint:
        if prefix:
            PREFIX_ROUTES.append((method, path, fn))
        else:
            ROUTES[(method, path)] = fn
        return fn

    return register


def find_route(method: str, path: str) -> Endpoint | None:
    found = ROUTES.get((method, path))
    if found is not None:
        return found
    for m, p, fn in PREFIX_ROUTES:
        if m == method and path.startswith(p):
            return fn
    return None


@route("GET", "/health")
def health(ex: Exchange) -> None:
    fake = ex.fake
    with fake.lock:
        fake.health_checks += 1
        checks = fake.health_checks
    limit = fake.modes.current().unhealthy_after
    if limit is not None and checks > limit:
        raise HttpError(503, "fake decoder: unhealthy (unhealthy_after)")
    if fake.loading():
        raise HttpError(503, "Loading model")
    ex.reply(200, {"status": "ok"})


@route("GET", "/v1/models")
@route("GET", "/models")
def models(ex: Exchange) -> None:
    alias = ex.fake.alias
    ex.reply(
        200,
        {
            "models": [{"name": alias, "model": alias, "type": "model", "capabilities": ["completion"]}],
            "object": "list",
            "data": [
                {
                    "id": alias,
                    "aliases": [alias],
                    "tags": [],
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "llamacpp",
                    "meta": {"n_vocab": N_VOCAB, "n_ctx": ex.fake.settings.ctx_size},
                }
            ],
        },
    )


@route("GET", "/props")
def props(ex: Exchange) -> None:
    s = ex.fake.settings
    ex.reply(
        200,
        {
            "default_generation_settings": {"n_ctx": s.ctx_size // s.parallel},
            "total_slots": s.parallel,
            "model_path": s.model,
            "model_alias": ex.fake.alias,
            "build_info": "fake_decoder",
        },
    )


@route("GET", "/slots")
def slots(ex: Exchange) -> None:
    s = ex.fake.settings
    with ex.fake.lock:
        busy = list(ex.fake.processing)
    ex.reply(
        200,
        [
            {"id": i, "n_ctx": s.ctx_size // s.parallel, "speculative": False, "is_processing": busy[i] > 0}
            for i in range(s.parallel)
        ],
    )


SlotAction = Callable[[Exchange, int], None]
SLOT_ACTIONS: dict[str, SlotAction] = {}


def slot_action_named(name: str) -> Callable[[SlotAction], SlotAction]:
    def register(fn: SlotAction) -> SlotAction:
        SLOT_ACTIONS[name] = fn
        return fn

    return register


@route("POST", "/slots/", prefix=True)
def slot_action(ex: Exchange) -> None:
    try:
        slot = int(ex.path.removeprefix("/slots/"))
    except ValueError:
        raise HttpError(400, "Invalid slot ID") from None
    if not 0 <= slot < ex.fake.settings.parallel:
        raise HttpError(400, "Invalid slot ID")
    action = ex.query.get("action", "")
    handler = SLOT_ACTIONS.get(action)
    if handler is None:
        raise HttpError(400, "Invalid action")
    handler(ex, slot)


# llama-server's own words for a restore that could not load the file.
RESTORE_FAILED = "Unable to restore slot, no available space in KV cache or invalid slot save file"
# The refusal the NPU fork answers for a hybrid model's cache (hybrid-route PR #1203).
SHARE_REFUSED = "the KV cache of a hybrid model cannot be shared"


def _state_path(ex: Exchange) -> tuple[str, Path]:
    """The request's filename and where it lives; refused as llama-server's fs_validate_filename does."""
    save_path = ex.fake.settings.slot_save_path
    if not save_path:
        raise HttpError(501, "This server does not support slots action. Start it with `--slot-save-path`")
    name = ex.json().get("filename")
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise HttpError(400, "Invalid filename")
    return name, Path(save_path) / name


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)


@slot_action_named("save")
def slot_save(ex: Exchange, slot: int) -> None:
    started = time.monotonic()
    name, path = _state_path(ex)
    with ex.fake.lock:
        tokens = list(ex.fake.cache[slot])
    data = json.dumps({"fake_state": True, "tokens": tokens}).encode()
    path.write_bytes(data)
    ex.fake.log({"event": "save", "slot": slot, "filename": name, "n_saved": len(tokens)})
    ex.reply(
        200,
        {
            "id_slot": slot,
            "filename": name,
            "n_saved": len(tokens),
            "n_written": len(data),
            "timings": {"save_ms": _elapsed_ms(started)},
        },
    )


@slot_action_named("restore")
def slot_restore(ex: Exchange, slot: int) -> None:
    started = time.monotonic()
    name, path = _state_path(ex)
    fake = ex.fake
    held = False
    while fake.modes.current().hold_restore:
        if not held:
            held = True
            fake.log({"event": "restore-held", "slot": slot, "filename": name})
        if ex.gone(POLL_S):
            fake.log({"event": "restore", "slot": slot, "filename": name, "disconnected": True})
            raise ClientGone()
    try:
        raw = path.read_bytes()
        state = json.loads(raw)
    except (OSError, ValueError):
        raw, state = b"", None
    tokens = state.get("tokens") if isinstance(state, dict) and state.get("fake_state") is True else None
    modes = fake.modes.current()
    if modes.restore_refuse or not _is_token_list(tokens):
        fake.log({"event": "restore", "slot": slot, "filename": name, "refused": True})
        raise HttpError(400, RESTORE_FAILED)
    assert isinstance(tokens, list)
    if not modes.restore_unused:
        fake.hand_over(slot, tokens)
    n_restored = len(tokens) - 1 if modes.restore_wrong_n else len(tokens)
    fake.log({"event": "restore", "slot": slot, "filename": name, "n_restored": n_restored, "tokens": tokens})
    ex.reply(
        200,
        {
            "id_slot": slot,
            "filename": name,
            "n_restored": n_restored,
            "n_read": len(raw),
            "timings": {"restore_ms": _elapsed_ms(started)},
        },
    )


@slot_action_named("erase")
def slot_erase(ex: Exchange, slot: int) -> None:
    n_erased = ex.fake.erase(slot)
    ex.fake.log({"event": "erase", "slot": slot, "n_erased": n_erased})
    ex.reply(200, {"id_slot": slot, "n_erased": n_erased})


@slot_action_named("share")
def slot_share(ex: Exchange, slot: int) -> None:
    body = ex.json()
    fake = ex.fake
    modes = fake.modes.current()
    path = body.get("socket")
    n_tokens = body.get("n_tokens")
    n_ctx = fake.settings.ctx_size // fake.settings.parallel
    fake.log({"event": "share", "slot": slot, "n_tokens": n_tokens})
    if modes.kvshare_refuse:
        # Exactly the fork's body, which onebitd quotes in its log line.
        ex.reply(400, {"error": {"message": SHARE_REFUSED}})
        return
    if not isinstance(path, str) or not path:
        raise HttpError(400, "'socket' must be a path")
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 0 < n_tokens <= n_ctx:
        raise HttpError(400, f"'n_tokens' must be between 1 and {n_ctx}")
    if modes.kvshare_no_id:
        ex.reply(200, {"id_slot": slot, "n_tokens": n_tokens})
        return
    with fake.lock:
        fake.share_seq += 1
        share_id = f"s-{os.getpid()}-{fake.share_seq}"
    share = Share(share_id, slot, n_ctx, 1 if modes.kvshare_regions == 1 else 2)
    with fake.lock:
        # A slot lends its cells once: a share nobody adopted is dropped by the next.
        replaced = [s for s in fake.shares.values() if s.slot == slot]
        for old in replaced:
            del fake.shares[old.share_id]
        fake.shares[share_id] = share
    for old in replaced:
        old.close()
    ex.reply(200, {"id_slot": slot, "share_id": share_id, "n_tokens": n_tokens})
    if modes.kvshare_no_connect:
        return
    # The fds are the header's regions, in order; a bad header leaves one out.
    _send_header(path, share.header, share.fds[:-1] if modes.kvshare_bad_header else share.fds)


def _send_header(path: str, header: dict[str, Any], fds: list[int]) -> None:
    payload = json.dumps(header).encode()
    message = struct.pack(">I", len(payload)) + payload
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)  # onebitd accepts at once or has given up on the share
        try:
            sock.connect(path)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            sent = sock.sendmsg([message], rights)
            sock.sendall(message[sent:])
        except OSError:
            pass  # it went away (the request was cancelled): the share is simply never adopted


@slot_action_named("adopt")
def slot_adopt(ex: Exchange, slot: int) -> None:
    body = ex.json()
    fake = ex.fake
    share_id = body.get("share_id")
    n_tokens = body.get("n_tokens")
    record: dict[str, Any] = {"event": "adopt", "slot": slot, "share_id": share_id, "n_tokens": n_tokens}
    with fake.lock:
        share = fake.shares.get(share_id) if isinstance(share_id, str) else None
        if share is not None and share.slot == slot:
            del fake.shares[share.share_id]
        else:
            share = None
    try:
        if share is None:
            refusal = f"Cannot adopt the shared cells: slot {slot} lent no share {share_id!r}"
        elif fake.modes.current().kvshare_adopt_refuse:
            refusal = "Cannot adopt the shared cells: another sequence holds them"
        elif not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
            refusal = "Cannot adopt the shared cells: 'n_tokens' must be a count"
        else:
            refusal = None
            tokens = share.valid_tokens(n_tokens)
    finally:
        if share is not None:
            share.close()
    if refusal is not None:
        fake.log({**record, "refused": refusal})
        raise HttpError(400, refusal)
    fake.hand_over(slot, tokens)
    fake.log({**record, "n_adopted": len(tokens)})
    ex.reply(200, {"id_slot": slot, "share_id": share_id, "n_adopted": len(tokens)})


@route("POST", "/tokenize")
def tokenize(ex: Exchange) -> None:
    body = ex.json()
    content = body.get("content", "")
    if not isinstance(content, str):
        raise HttpError(400, "'content' must be a string")
    ids = ex.fake.tokenize(content)
    if body.get("with_pieces") is True:
        with ex.fake.lock:
            ex.reply(200, {"tokens": [{"id": i, "piece": ex.fake.vocab[i]} for i in ids]})
        return
    ex.reply(200, {"tokens": ids})


@route("POST", "/detokenize")
def detokenize(ex: Exchange) -> None:
    tokens = ex.json().get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise HttpError(400, "'tokens' must be an array of integers")
    with ex.fake.lock:
        words = [ex.fake.vocab.get(t, f"<{t}>") for t in tokens]
    ex.reply(200, {"content": " ".join(words)})


@route("POST", "/apply-template")
def apply_template(ex: Exchange) -> None:
    ex.reply(200, {"prompt": chatml(ex.json().get("messages"))})


# -- completions ------------------------------------------------------------------------------------


@dataclass
class Job:
    """A completion request, validated: what to say and how to frame it."""

    path: str
    body: dict[str, Any]
    prompt: str  # what is tokenized (for chat: the templated conversation)
    echo: list[str]  # the words the reply repeats
    n_predict: int
    stream: bool
    seq: int = 0
    slot: int = 0
    id: str = ""

    @property
    def openai(self) -> bool:
        return self.path != "/completion"

    @property
    def chat(self) -> bool:
        return self.path == "/v1/chat/completions"


def _n_predict(body: dict[str, Any], *names: str) -> int:
    for name in names:
        if name in body and body[name] is not None:
            value = body[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise HttpError(400, f"Field '{name}': Value must be between -1 <= value <= 2147483647, got {value!r}")
            return DEFAULT_PREDICT if value == -1 else value
    return DEFAULT_PREDICT


def parse_job(path: str, body: dict[str, Any]) -> Job:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, "'stream' must be a boolean")
    if path == "/v1/chat/completions":
        prompt = chatml(body.get("messages"))
        echo = content_text(body["messages"][-1].get("content")).split()
        n = _n_predict(body, "max_completion_tokens", "max_tokens", "n_predict")
    else:
        raw = body.get("prompt")
        if path == "/v1/completions" and isinstance(raw, list) and raw and isinstance(raw[0], str):
            raw = raw[0]
        if raw is None:
            raise HttpError(400, "[json.exception.out_of_range.403] key 'prompt' not found")
        if not isinstance(raw, str):
            raise HttpError(400, '"prompt" must be a string')
        prompt, echo = raw, raw.split()
        names = ("n_predict",) if path == "/completion" else ("max_tokens", "n_predict")
        n = _n_predict(body, *names)
    return Job(path, body, prompt, echo or ["ok"], n, stream)


def _held(fake: Fake, job: Job) -> bool:
    hold = fake.modes.current().hold
    if isinstance(hold, list):
        return any(isinstance(h, str) and h in job.prompt for h in hold)
    return bool(hold)


@route("POST", "/completion")
@route("POST", "/v1/completions")
@route("POST", "/v1/chat/completions")
def completion(ex: Exchange) -> None:
    body = ex.json()
    job = parse_job(ex.path, body)
    fake = ex.fake
    prompt_tokens = fake.tokenize(job.prompt)
    claimed = fake.claim(body.get("id_slot"), prompt_tokens)
    job.slot, slot_busy, job.seq, cache_n = claimed.slot, claimed.busy, claimed.seq, claimed.cache_n
    job.id = f"{'chatcmpl' if job.chat else 'cmpl'}-fake{os.getpid()}x{job.seq}"
    fake.log({"event": "arrived", "seq": job.seq, "id_slot": body.get("id_slot"), "slot": job.slot})
    if claimed.stale is not None:
        # Decoding from cells that hold another prompt: a wrong answer, as the real decoder gives.
        job.echo = ["stale-kv", *(fake.word(t) for t in claimed.stale)]
    words = [job.echo[i % len(job.echo)] for i in range(job.n_predict)]
    sent = 0
    logged = False

    def done(*, finished: bool, disconnected: bool) -> None:
        """Free the slot and log the request, once.  A reply that ends well does this before its
        last bytes leave, so a client that has the whole reply can count on the log line (and a
        fake stopped right after cannot lose it)."""
        nonlocal logged
        if logged:
            return
        logged = True
        fake.release(job.slot, prompt_tokens + [token_id(w) for w in words[:sent]])
        fake.log(
            {
                "event": "completion",
                "seq": job.seq,
                "path": job.path,
                "id_slot": body.get("id_slot"),
                "slot": job.slot,
                "slot_busy": slot_busy,
                "stream": job.stream,
                "prompt": job.prompt,
                "n_predict": job.n_predict,
                "sent": sent,
                "finished": finished,
                "disconnected": disconnected,
                "cache_n": cache_n,
                "prompt_n": len(prompt_tokens) - cache_n,
            }
        )

    try:
        modes = fake.modes.current()
        if modes.hang:
            while not ex.gone(POLL_S * 5):
                pass
            raise ClientGone()
        if job.stream:
            ex.start_stream()
            if job.chat:
                ex.send_event(_chat_chunk(fake, job, {"role": "assistant", "content": None}, None))
            for i, word in enumerate(words):
                if i and modes.token_delay_s and ex.gone(modes.token_delay_s):
                    raise ClientGone()
                ex.send_event(_token_event(fake, job, word, i, len(prompt_tokens)))
                sent += 1
                _wait_while_held(ex, job)
            for event in final_events(fake, job, cache_n, len(prompt_tokens), len(words)):
                ex.send_event(event)
            if job.openai:
                ex.send_event("[DONE]")
            done(finished=True, disconnected=False)
            ex.end_stream()
        else:
            _wait_while_held(ex, job)
            text = _join(job, words)
            sent = len(words)
            done(finished=True, disconnected=False)
            ex.reply(200, _final(fake, job, text, cache_n, len(prompt_tokens), len(words)))
    except ClientGone:
        done(finished=False, disconnected=True)
        raise
    finally:
        done(finished=False, disconnected=False)


def _wait_while_held(ex: Exchange, job: Job) -> None:
    while _held(ex.fake, job):
        if ex.gone(POLL_S):
            raise ClientGone()


def _join(job: Job, words: list[str]) -> str:
    text = " ".join(words)
    return text if job.chat else " " + text


def _piece(job: Job, word: str, index: int) -> str:
    return word if job.chat and index == 0 else " " + word


def _chat_chunk(fake: Fake, job: Job, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
        "created": int(time.time()),
        "id": job.id,
        "model": fake.alias,
        "system_fingerprint": "b0-fake",
        "object": "chat.completion.chunk",
    }


def _token_event(fake: Fake, job: Job, word: str, index: int, n_prompt: int) -> dict[str, Any]:
    piece = _piece(job, word, index)
    if job.chat:
        return _chat_chunk(fake, job, {"content": piece}, None)
    if job.openai:
        return {
            "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
            "created": int(time.time()),
            "model": fake.alias,
            "system_fingerprint": "b0-fake",
            "object": "text_completion",
            "id": job.id,
        }
    return {
        "index": 0,
        "content": piece,
        "tokens": [token_id(word)],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": index + 1,
        "tokens_evaluated": n_prompt,
    }


def _usage(cache_n: int, n_prompt: int, n_out: int) -> dict[str, Any]:
    return {
        "completion_tokens": n_out,
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + n_out,
        "prompt_tokens_details": {"cached_tokens": cache_n},
    }


def final_events(fake: Fake, job: Job, cache_n: int, n_prompt: int, n_out: int) -> list[dict[str, Any]]:
    """A stream's last events (before ``[DONE]``), the last one with ``timings``: for chat, the chunk
    with the finish reason and, when ``stream_options.include_usage`` asks for it, one with no
    choices and the ``usage`` (server-task.cpp's ``to_json_oaicompat_chat_stream``)."""
    last = _final(fake, job, "", cache_n, n_prompt, n_out)
    options = job.body.get("stream_options")
    if not (job.chat and isinstance(options, dict) and options.get("include_usage") is True):
        return [last]
    t = last.pop("timings")
    usage = {**_chat_chunk(fake, job, {}, None), "choices": [], "usage": _usage(cache_n, n_prompt, n_out)}
    return [last, {**usage, "timings": t}]


def _final(fake: Fake, job: Job, text: str, cache_n: int, n_prompt: int, n_out: int) -> dict[str, Any]:
    """The whole reply, or (``text`` empty) a stream's last event: both carry ``timings``."""
    t = timings(cache_n, n_prompt - cache_n, n_out)
    usage = _usage(cache_n, n_prompt, n_out)
    if not job.openai:
        return {
            "index": 0,
            "content": text,
            "tokens": [],
            "id_slot": job.slot,
            "stop": True,
            "model": fake.alias,
            "tokens_predicted": n_out,
            "tokens_evaluated": n_prompt,
            "generation_settings": {"n_predict": job.n_predict, "stream": job.stream},
            "prompt": job.prompt,
            "has_new_line": "\n" in text,
            "truncated": False,
            "stop_type": "limit",
            "stopping_word": "",
            "tokens_cached": n_prompt + n_out,
            "timings": t,
        }
    if job.chat and job.stream:
        chunk = _chat_chunk(fake, job, {}, "length")
        chunk["timings"] = t
        return chunk
    common = {
        "created": int(time.time()),
        "model": fake.alias,
        "system_fingerprint": "b0-fake",
    }
    if job.chat:
        message = {"role": "assistant", "content": text}
        choice: dict[str, Any] = {"finish_reason": "length", "index": 0, "message": message}
        return {
            "choices": [choice],
            **common,
            "object": "chat.completion",
            "usage": usage,
            "id": job.id,
            "timings": t,
        }
    choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}
    return {
        "choices": [choice],
        **common,
        "object": "text_completion",
        "usage": usage,
        "id": job.id,
        "timings": t,
    }


# -- start ------------------------------------------------------------------------------------------


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


def parse_args(argv: list[str]) -> Settings:
    settings = Settings(argv=list(argv))
    args = iter(argv)
    for arg in args:
        name, eq, inline = arg.partition("=")
        key = OPTIONS.get(name if eq else arg)
        if key is None:
            continue
        value = inline if eq else next(args, "")
        setattr(settings, key, int(value) if key in ("ctx_size", "parallel", "port") else value)
    settings.parallel = max(1, settings.parallel)
    return settings


class UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # a held request must not keep a SIGTERMed fake alive
    block_on_close = False


def _count_start(modes: ModeSource) -> int:
    """This start's number, 1 for the first; counted next to the control file."""
    if modes.control is None:
        return 1
    counter = modes.control.with_name(modes.control.name + ".starts")
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
    settings = parse_args(argv)
    source = ModeSource()
    modes = source.current()
    start = _count_start(source)
    fake = Fake(settings, source)
    fake.log({"event": "start", "start": start, "argv": argv})
    if modes.exit is not None and (modes.exit_starts is None or start <= modes.exit_starts):
        print(f"fake_decoder: exiting with status {modes.exit} as told", flush=True)
        return modes.exit
    if modes.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))

    handler = type("BoundHandler", (Handler,), {"fake": fake})
    server: socketserver.BaseServer
    if settings.host.endswith(".sock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(settings.host)
        server = UnixHTTPServer(settings.host, handler)
        where = settings.host
    else:
        server = ThreadingHTTPServer((settings.host, settings.port), handler)
        where = f"http://{settings.host}:{settings.port}"
    print(f"fake_decoder: pid {os.getpid()} listening on {where} with {settings.parallel} slots", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
        if settings.host.endswith(".sock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.host)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
