"""The fake llama-server's core: what it answers to a method, path and body, and its slots.  No I/O
and no waiting: :meth:`Core.answer` returns a generator of :data:`Step`\\ s that an adapter drives
(tests/fakes/llama/inprocess.py in this process, tests/fakes/llama/process.py as a program).

Steering: the fields of :class:`Modes`, read through the ``modes`` callable whenever a mode matters
(the in-process adapter swaps one frozen value; the program reads the control file).  What it did
goes to ``log``, one record per event (documented in tests/fakes/llama/process.py, which writes them
to a file).

    load_s                /health says "Loading model" (503) for this many seconds after start
    loading               true: loading until the modes say otherwise
    exit, exit_starts     (the program) exit with this status right after start; only the first N starts
    unhealthy_after       after N health checks, /health answers 503 forever
    token_delay_s         seconds between streamed tokens
    hang                  completions never answer (until released, or the client leaves)
    hold                  true: a completion pauses after each streamed token (a whole reply: before
                          answering; a prefill, with no token to send, never) while this holds; a list
                          of strings holds only the requests whose prompt contains one of them
    ignore_sigterm        (the program) ignore SIGTERM, so only SIGKILL stops it
    hold_restore          a restore waits while this holds (logs ``restore-held`` once)
    hold_save             a save waits while this holds (logs ``save-held`` once)
    restore_refuse        restores answer 400, as for a file saved elsewhere
    restore_wrong_n       a restore loads the file but answers one token short
    restore_unused        a restore answers success but leaves the slot as it was, so the next completion
                          re-evaluates the prompt (ggml-org/llama.cpp#26676)
    recurrent             a slot's state cannot be cut back to an earlier token: a slot that holds more
                          than the prompt's common prefix, or all of the prompt, evaluates it from the start
    kvshare_refuse        ?action=share answers 400, as the NPU fork does for a hybrid model's cache
    kvshare_no_id         ?action=share answers 200 without a share_id
    kvshare_no_connect    ... answers a share_id but never connects
    kvshare_bad_header    ... sends a header with one fd fewer than regions
    kvshare_adopt_refuse  ?action=adopt answers 400 "Cannot adopt ..."
    kvshare_regions       how many regions a share lends (1 or 2, default 2)
    kvshare_state         a share lends a hybrid's staging region too (recurrent state rows, kinds r and s)

The slot cache.  Each slot holds the tokens of its KV cells.  A completion on a slot whose cells hold a
prefix of its prompt evaluates only the rest (``prompt_n`` = prompt - cached, at least 1, as llama-server
re-evaluates the last token for its logits; ``cache_n`` = cached); afterwards the slot holds the prompt
(not the reply: a slot saved for the prefix store holds what onebitd counts it to hold; under
``recurrent`` it holds the reply sent too, as a hybrid model's state does).  Cells that
came from a handoff (a restore or an adopt) are taken as the prompt's, for as many positions as they
cover, without comparing tokens: a handed-over state's token ids are only labels on its KV, and KV
computed for other tokens decodes to a wrong answer.  So when they hold other
tokens than the prompt's, the reply is derived from them (its first word ``stale-kv``), and a broken
handoff shows as a wrong answer, not only as a slow one.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .share import Share
from .steps import Answer, HttpError, Request, Whole, dump

N_VOCAB = 49152  # SmolLM2's vocabulary size, so token ids look plausible
PROMPT_MS_PER_TOKEN = 0.5
PREDICT_MS_PER_TOKEN = 1.0


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
    hold_save: bool = False
    restore_refuse: bool = False
    restore_wrong_n: bool = False
    restore_unused: bool = False
    recurrent: bool = False
    kvshare_refuse: bool = False
    kvshare_no_id: bool = False
    kvshare_no_connect: bool = False
    kvshare_bad_header: bool = False
    kvshare_adopt_refuse: bool = False
    kvshare_regions: int = 2
    kvshare_state: bool = False


@dataclass(frozen=True)
class Settings:
    """What llama-server is started with, as far as its answers show it."""

    n_slots: int = 2
    n_ctx: int | None = None  # a slot's context; None: unknown, and no prompt is too long
    alias: str = "fake-model"
    model: str = ""
    slot_save_path: str = ""  # where slot actions read and write; "" refuses them, as llama-server does
    kvshare: bool = False  # the fork's ?action=share and adopt; a stock llama-server answers 400
    # /completion takes a prompt of token ids.  The program does not: onebitd's restore probe (which
    # prefills token ids) then cannot run, and a daemon test sees only its own requests.
    token_prompts: bool = True


# -- the model, such as it is -----------------------------------------------------------------------


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % N_VOCAB


def tokenize(text: str) -> list[int]:
    """The fake's tokenizer, pure: one token per whitespace-separated word."""
    return [token_id(word) for word in text.split()]


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
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_n * PROMPT_MS_PER_TOKEN,
        "prompt_per_token_ms": PROMPT_MS_PER_TOKEN,
        "prompt_per_second": 1000 / PROMPT_MS_PER_TOKEN,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_n * PREDICT_MS_PER_TOKEN,
        "predicted_per_token_ms": PREDICT_MS_PER_TOKEN,
        "predicted_per_second": 1000 / PREDICT_MS_PER_TOKEN,
    }


# -- the server's state -----------------------------------------------------------------------------


@dataclass
class Claimed:
    """A completion's slot, as :meth:`Core.claim` hands it out."""

    slot: int
    busy: bool  # another request was in flight on it
    seq: int
    cache_n: int
    stale: list[int] | None  # handed-over cells that hold other tokens than the prompt's


@dataclass
class Core:
    """The fake llama-server's state and its answers; ``lock`` guards the mutable parts (the program
    answers each connection in its own thread)."""

    settings: Settings
    modes: Callable[[], Modes]
    log: Callable[[dict[str, Any]], None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.monotonic)
    health_checks: int = 0
    seq: int = 0
    cache: list[list[int]] = field(init=False)  # each slot's KV, as tokens
    processing: list[int] = field(init=False)  # requests in flight per slot
    # The slot's cells came from a restore or an adopt: the next completion takes them as given.
    handed: list[bool] = field(init=False)
    shares: dict[str, Share] = field(default_factory=dict)
    share_seq: int = 0
    vocab: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.settings.n_slots
        self.cache, self.processing, self.handed = [[] for _ in range(n)], [0] * n, [False] * n

    def answer(self, method: str, path: str, query: dict[str, str], raw: bytes) -> Answer:
        """The steps of the answer to one request; an error is a whole reply in llama-server's shape."""
        request = Request(method, path, query, raw)
        try:
            endpoint = find_route(method, path)
            if endpoint is None:
                raise HttpError(404, "File Not Found")
            if path != "/health" and self.loading():
                raise HttpError(503, "Loading model")
            yield from endpoint(self, request)
        except HttpError as exc:
            yield Whole(exc.status, dump(exc.body()), close=True)

    def loading(self) -> bool:
        modes = self.modes()
        return modes.loading or time.monotonic() - self.started < modes.load_s

    def tokenize(self, text: str) -> list[int]:
        """:func:`tokenize`, remembering each word for /detokenize and a stale reply."""
        ids = tokenize(text)
        with self.lock:
            self.vocab.update(zip(ids, text.split(), strict=True))
        return ids

    def word(self, token: int) -> str:
        with self.lock:
            return self.vocab.get(token, f"<{token}>")

    def claim(self, asked: Any, prompt: list[int], *, cache: bool = True) -> Claimed:
        """Take a slot for a request, and see what its cache holds of the prompt."""
        recurrent = self.modes().recurrent
        with self.lock:
            self.seq += 1
            n = self.settings.n_slots
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
            cache_n = max(0, min(common, len(prompt) - 1)) if cache else 0
            if recurrent and (common < len(cached) or common >= len(prompt)):
                cache_n = 0  # the state holds more than the common prefix: it cannot be cut back
            seq = self.seq
        content = self.content(slot)
        stale = content[:cache_n] if content[:cache_n] != prompt[:cache_n] else None
        return Claimed(slot, busy, seq, cache_n, stale)

    def content(self, slot: int) -> list[int]:
        """What the slot's cells really hold: a lent region is the slot's KV, so rows a provider wrote
        into a share that was neither adopted nor erased have overwritten the cells under their tokens."""
        with self.lock:
            content = list(self.cache[slot])
            shares = [share for share in self.shares.values() if share.slot == slot]
        for share in shares:
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

    def empty(self) -> None:
        """Every slot empty, as after a restart."""
        for slot in range(self.settings.n_slots):
            self.erase(slot)


# -- endpoints --------------------------------------------------------------------------------------

Endpoint = Callable[[Core, Request], Answer]
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
