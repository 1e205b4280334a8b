"""The fake llama-server's slot actions, ``POST /slots/<id>?action=...`` (a filename with a path
separator is refused with 400 "Invalid filename", as llama-server's validation does; without a
``--slot-save-path`` save and restore answer 501):

    save     {"filename"}          writes llama.cpp's magic and {"fake_state": true, "tokens": [...]}
                                   into the slot save path (the prefix store checks the magic)
    restore  {"filename"}          reads such a file (with or without the magic) into the slot; 400 if it
                                   is missing or not one
    erase                          empties the slot
    share    {"socket", "n_tokens"}  lends the slot's KV (tests/fakes/llama/share.py): answers {"share_id"},
                                   then connects to ``socket`` and sends the header and, by SCM_RIGHTS,
                                   one memfd per region
    adopt    {"share_id", "n_tokens"}  reads the rows back: the slot then holds the tokens of the rows
                                   that are right from position 0 up to the first wrong or missing one,
                                   so a short region makes the next completion evaluate the rest

A lent region is the slot's own KV: until an adopt or an erase ends the share, rows written into it
have overwritten the slot's cells, and a completion that reuses those cells answers from the rows.
Each action logs ``{"event": "<action>", "slot", ...}`` with what it did (``n_saved``, ``n_restored``,
``n_adopted``, ``refused``, ``disconnected``); a held save or restore ``save-held``/``restore-held``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.llama.statefile import MAGIC_BYTES as STATE_MAGIC

from .core import Core, route
from .share import Share, send_header
from .steps import After, Answer, HttpError, Pause, Request, reply

# llama-server's own words for a restore that could not load the file.
RESTORE_FAILED = "Unable to restore slot, no available space in KV cache or invalid slot save file"
# The refusal the NPU fork answers for a hybrid model's cache (hybrid-route PR #1203).
SHARE_REFUSED = "the KV cache of a hybrid model cannot be shared"

SlotAction = Callable[[Core, Request, int], Answer]
SLOT_ACTIONS: dict[str, SlotAction] = {}


def slot_action_named(name: str) -> Callable[[SlotAction], SlotAction]:
    def register(fn: SlotAction) -> SlotAction:
        SLOT_ACTIONS[name] = fn
        return fn

    return register


@route("POST", "/slots/", prefix=True)
def slot_action(core: Core, request: Request) -> Answer:
    try:
        slot = int(request.path.removeprefix("/slots/"))
    except ValueError:
        raise HttpError(400, "Invalid slot ID") from None
    if not 0 <= slot < core.settings.n_slots:
        raise HttpError(400, "Invalid slot ID")
    action = request.query.get("action", "")
    handler = SLOT_ACTIONS.get(action)
    if handler is None or (action in ("share", "adopt") and not core.settings.kvshare):
        raise HttpError(400, "Invalid action")
    yield from handler(core, request, slot)


def _state_path(core: Core, request: Request) -> tuple[str, Path]:
    """The request's filename and where it lives; refused as llama-server's fs_validate_filename does."""
    save_path = core.settings.slot_save_path
    if not save_path:
        raise HttpError(501, "This server does not support slots action. Start it with `--slot-save-path`")
    name = request.json().get("filename")
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise HttpError(400, "Invalid filename")
    return name, Path(save_path) / name


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _elapsed_ms(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)


def _held(core: Core, record: dict[str, Any], holds: Callable[[], bool]) -> Answer:
    """Wait while ``holds()``, logging ``<action>-held`` once, and the action ``disconnected`` when the
    client leaves meanwhile."""
    if not holds():
        return
    core.log({**record, "event": record["event"] + "-held"})
    try:
        yield Pause(holds)
    except GeneratorExit:
        core.log({**record, "disconnected": True})
        raise


@slot_action_named("save")
def slot_save(core: Core, request: Request, slot: int) -> Answer:
    started = time.monotonic()
    name, path = _state_path(core, request)
    record = {"event": "save", "slot": slot, "filename": name}
    yield from _held(core, record, lambda: core.modes().hold_save)
    with core.lock:
        tokens = list(core.cache[slot])
    data = STATE_MAGIC + json.dumps({"fake_state": True, "tokens": tokens}).encode()
    path.write_bytes(data)
    core.log({**record, "n_saved": len(tokens)})
    timings = {"save_ms": _elapsed_ms(started)}
    yield reply(
        200, {"id_slot": slot, "filename": name, "n_saved": len(tokens), "n_written": len(data), "timings": timings}
    )


@slot_action_named("restore")
def slot_restore(core: Core, request: Request, slot: int) -> Answer:
    started = time.monotonic()
    name, path = _state_path(core, request)
    record = {"event": "restore", "slot": slot, "filename": name}
    yield from _held(core, record, lambda: core.modes().hold_restore)
    try:
        raw = path.read_bytes()
        state = json.loads(raw.removeprefix(STATE_MAGIC))
    except (OSError, ValueError):
        raw, state = b"", None
    tokens = state.get("tokens") if isinstance(state, dict) and state.get("fake_state") is True else None
    modes = core.modes()
    if modes.restore_refuse or not _is_token_list(tokens):
        core.log({**record, "refused": True})
        raise HttpError(400, RESTORE_FAILED)
    assert isinstance(tokens, list)
    if not modes.restore_unused:
        core.hand_over(slot, tokens)
    n_restored = len(tokens) - 1 if modes.restore_wrong_n else len(tokens)
    core.log({**record, "n_restored": n_restored, "tokens": tokens})
    timings = {"restore_ms": _elapsed_ms(started)}
    yield reply(
        200, {"id_slot": slot, "filename": name, "n_restored": n_restored, "n_read": len(raw), "timings": timings}
    )


@slot_action_named("erase")
def slot_erase(core: Core, request: Request, slot: int) -> Answer:
    n_erased = core.erase(slot)
    core.log({"event": "erase", "slot": slot, "n_erased": n_erased})
    yield reply(200, {"id_slot": slot, "n_erased": n_erased})


@slot_action_named("share")
def slot_share(core: Core, request: Request, slot: int) -> Answer:
    body = request.json()
    modes = core.modes()
    path = body.get("socket")
    n_tokens = body.get("n_tokens")
    n_ctx = core.settings.n_ctx or 0
    core.log({"event": "share", "slot": slot, "n_tokens": n_tokens})
    if modes.kvshare_refuse:
        # Exactly the fork's body, which onebitd quotes in its log line.
        yield reply(400, {"error": {"message": SHARE_REFUSED}})
        return
    if not isinstance(path, str) or not path:
        raise HttpError(400, "'socket' must be a path")
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or not 0 < n_tokens <= n_ctx:
        raise HttpError(400, f"'n_tokens' must be between 1 and {n_ctx}")
    if modes.kvshare_no_id:
        yield reply(200, {"id_slot": slot, "n_tokens": n_tokens})
        return
    with core.lock:
        core.share_seq += 1
        share_id = f"s-{os.getpid()}-{core.share_seq}"
    share = Share(share_id, slot, n_ctx, 1 if modes.kvshare_regions == 1 else 2, state=modes.kvshare_state)
    with core.lock:
        # A slot lends its cells once: a share nobody adopted is dropped by the next.
        replaced = [s for s in core.shares.values() if s.slot == slot]
        for old in replaced:
            del core.shares[old.share_id]
        core.shares[share_id] = share
    for old in replaced:
        old.close()
    yield reply(200, {"id_slot": slot, "share_id": share_id, "n_tokens": n_tokens})
    if not modes.kvshare_no_connect:
        # The fds are the header's regions, in order; a bad header leaves one out.
        fds = share.fds[:-1] if modes.kvshare_bad_header else share.fds
        yield After(lambda: send_header(path, share.header, fds))


@slot_action_named("adopt")
def slot_adopt(core: Core, request: Request, slot: int) -> Answer:
    body = request.json()
    share_id = body.get("share_id")
    n_tokens = body.get("n_tokens")
    record: dict[str, Any] = {"event": "adopt", "slot": slot, "share_id": share_id, "n_tokens": n_tokens}
    with core.lock:
        share = core.shares.get(share_id) if isinstance(share_id, str) else None
        if share is not None and share.slot == slot:
            del core.shares[share.share_id]
        else:
            share = None
    tokens: list[int] = []
    try:
        if share is None:
            refusal: str | None = f"Cannot adopt the shared cells: slot {slot} lent no share {share_id!r}"
        elif core.modes().kvshare_adopt_refuse:
            refusal = "Cannot adopt the shared cells: another sequence holds them"
        elif not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 0:
            refusal = "Cannot adopt the shared cells: 'n_tokens' must be a count"
        else:
            refusal = None
            tokens = share.valid_tokens(n_tokens)
            if share.state_tensors:
                record["state_ok"] = share.state_written(tokens)
    finally:
        if share is not None:
            share.close()
    if refusal is not None:
        core.log({**record, "refused": refusal})
        raise HttpError(400, refusal)
    core.hand_over(slot, tokens)
    core.log({**record, "n_adopted": len(tokens)})
    yield reply(200, {"id_slot": slot, "share_id": share_id, "n_adopted": len(tokens)})
