"""The share route's handshake: the decoder lends its KV region to us as file descriptors.

Per request (slot S, M prompt tokens):

1. We listen on a fresh unix socket in the runtime directory (mode 0600).
2. ``POST /slots/S?action=share {"socket": <path>, "n_tokens": M}``; the reply must be 2xx JSON with
   a string ``share_id``.
3. The decoder connects and sends one message: a 4-byte big-endian length, then a UTF-8 JSON header,
   with the region fds attached (SCM_RIGHTS) in the order of ``regions``: the slot's KV, and for a
   hybrid model a second region staging its recurrent state (rows of kind ``r``, ``p``, ``s``).

Any failure here is a :class:`ShareRefused`: nothing was written into the region yet, so the request
may still take the file route.  :class:`SharedRegion` owns the received fds; closing it closes them,
and the socket file is removed on every path.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import secrets
import socket
import struct
from pathlib import Path
from typing import Any

import attrs
import trio

from ..errors import ShareRefused
from ..llama import decoder
from ..llama.region import KV_KINDS, STATE_KINDS
from ..providers import Provider, ShareJob
from ..reasons import Reason
from .capability import Capability
from .decision import Outcome, Route, Step
from .file import SlotClient, erase_slot
from .prefill import prefill

log = logging.getLogger("onebit.hybrid")

# A header describes every layer's K and V tensors: a few KB for any model we know of.
_MAX_HEADER = 1 << 20
# Regions per share: one per backend buffer; more than this is not a layout, it is a bug.
_MAX_FDS = 64
# The erase after a cancelled share runs shielded; a local erase answers in milliseconds, and a hung
# decoder must not hold a cancellation (a client gone, a shutdown) for longer than this.
_ERASE_ON_CANCEL_S = 2.0


@attrs.define
class SharedRegion:
    share_id: str
    layout: dict[str, Any]
    fds: list[int]

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


async def _receive_header(conn: trio.socket.SocketType) -> tuple[bytes, list[int]]:
    """Read the length-prefixed header, collecting every fd that arrives with it."""
    data = b""
    fds: list[int] = []
    try:
        need = 4
        while len(data) < need:
            chunk, ancdata, _flags, _addr = await conn.recvmsg(
                65536, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
            )
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(payload[: len(payload) - len(payload) % received.itemsize])
                    fds.extend(received)
            if not chunk:
                raise ShareRefused(f"the decoder closed the share socket after {len(data)} bytes")
            data += chunk
            if len(data) >= 4:
                (length,) = struct.unpack(">I", data[:4])
                if length > _MAX_HEADER:
                    raise ShareRefused(f"share header of {length} bytes is over {_MAX_HEADER}")
                need = 4 + length
        return data[4:need], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def parse_header(raw: bytes, fds: list[int]) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ShareRefused(f"the share header does not parse: {exc}") from None
    if not isinstance(header, dict):
        raise ShareRefused("the share header is not a JSON object")
    regions = header.get("regions")
    if not isinstance(regions, list) or not regions:
        raise ShareRefused("the share header has no regions")
    if len(fds) != len(regions):
        raise ShareRefused(f"the share header lists {len(regions)} regions but {len(fds)} fds came with it")
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise ShareRefused("the share header has no tensors")
    for tensor in tensors:
        if not isinstance(tensor, dict) or not all(
            isinstance(tensor.get(k), int) for k in ("region", "offset", "row_bytes")
        ):
            raise ShareRefused(f"a share tensor is malformed: {tensor!r:.200}")
        if not 0 <= tensor["region"] < len(regions):
            raise ShareRefused(f"a share tensor names region {tensor['region']} of {len(regions)}")
        if tensor.get("kind") not in KV_KINDS + STATE_KINDS:
            # A provider writes the rows it knows: one it skipped would be decoded from as written.
            raise ShareRefused(f"a share tensor of kind {tensor.get('kind')!r}, which no provider here can write")
    return header


class ShareHandshake:
    def __init__(self, *, client: SlotClient, runtime_dir: Path, connect_timeout_s: float) -> None:
        self.client = client
        self.runtime_dir = runtime_dir
        self.connect_timeout_s = connect_timeout_s

    async def open(self, *, req: str, slot: int, n_tokens: int) -> SharedRegion:
        """Steps 1-3; raises ShareRefused (or Cancelled) with nothing left open behind it."""
        path = self.runtime_dir / f"share-{req}-{secrets.token_hex(4)}.sock"
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                await listener.bind(str(path))
                os.chmod(path, 0o600)
                listener.listen(1)
            except OSError as exc:
                raise ShareRefused(f"cannot listen on {path}: {exc.strerror or exc}") from None
            share_id = await decoder.share(self.client, slot, path, n_tokens)
            if isinstance(share_id, decoder.Refusal):
                if share_id.status == 0:
                    raise ShareRefused(f"share failed: {share_id.words}")
                # The whole answer: a share's refusal says which part of the layout it cannot lend.
                raise ShareRefused(f"{share_id.what}: {share_id.answer}")
            with trio.move_on_after(self.connect_timeout_s) as waited:
                conn, _ = await listener.accept()
            if waited.cancelled_caught:
                raise ShareRefused(f"the decoder did not connect within {self.connect_timeout_s:g}s")
            with conn:
                with trio.move_on_after(self.connect_timeout_s) as read:
                    raw, fds = await _receive_header(conn)
                if read.cancelled_caught:
                    raise ShareRefused(f"the decoder sent no header within {self.connect_timeout_s:g}s")
            try:
                header = parse_header(raw, fds)
            except ShareRefused:
                for fd in fds:
                    os.close(fd)
                raise
            if header.get("share_id", share_id) != share_id:
                for fd in fds:
                    os.close(fd)
                raise ShareRefused(f"the header is for share {header.get('share_id')!r}, not {share_id!r}")
            return SharedRegion(share_id, header, fds)
        finally:
            listener.close()
            path.unlink(missing_ok=True)


class ShareHandoff:
    """The share route's effects.  ``run`` returns an :class:`Outcome`: ``ok`` (the slot holds the
    prompt), or the step that failed: ``SHARE_HANDSHAKE`` (nothing was written: the file route may
    still run), ``SHARE_PREFILL`` or ``ADOPT`` (a provider ran, or may have).  Which route follows
    is ``routes.DEGRADE``'s to say, not this class's.
    """

    def __init__(
        self,
        *,
        client: SlotClient,
        handshake: ShareHandshake,
        model: str,
        n_ctx: int,
        memory: str | None = None,
        capability: Capability | None = None,
    ) -> None:
        """``memory``: the decoder's memory layout (gguf.Shape.memory; None: its header is unknown),
        which every request a refusal sends elsewhere names on its route line.  ``capability``: where
        what is handed over ends (a hybrid model's at the prompt's boundary); None: the whole prompt."""
        self.client = client
        self.capability = capability
        self.handshake = handshake
        self.model = model
        self.n_ctx = n_ctx
        self.memory = memory or "unknown"
        # The decoder generation that refused to share, and why: until it restarts, do not ask again.
        self.refused_generation: int | None = None
        self.refused_why = ""
        self._told_remembered = False

    def refusal(self, generation: int) -> str | None:
        """Why decoder ``generation`` refused to share, with its memory layout (``/health``'s
        ``share_refused``); None when it has not.  Logs nothing, unlike :meth:`refused_by`."""
        return self.refused_why if self.refused_generation == generation else None

    def refused_by(self, generation: int) -> str | None:
        """The decoder's memory layout when this decoder process refused to share, else None."""
        if self.refused_generation != generation:
            return None
        if not self._told_remembered:
            self._told_remembered = True
            log.info("hybrid: this decoder refused to share its KV; the state-file route is used until it restarts")
        return self.memory

    async def run(
        self,
        *,
        req: str,
        slot: int,
        tokens: list[int],
        provider: Provider,
        generation: int,
        timeout_s: float,
        end: int | None = None,
    ) -> Outcome:
        """``end``: the prompt's boundary, where a state that cannot be cut back ends (as on the
        file route); the decoder evaluates the tokens after it."""
        if self.capability is not None:
            tokens = self.capability.handed_over(tokens, end)
        expected = len(tokens)
        started = trio.current_time()
        try:
            region = await self.handshake.open(req=req, slot=slot, n_tokens=expected)
        except ShareRefused as exc:
            self.refused_generation = generation
            self.refused_why = f"{exc.reason}; this decoder cannot share its KV (memory {self.memory})"
            self._told_remembered = False
            return Outcome(
                Route.SHARE,
                Step.SHARE_HANDSHAKE,
                Reason.SHARE_REFUSED,
                f"{exc.reason}; this decoder cannot share its KV",
                share_ms=0.0,
                memory=self.memory,
            )
        share_ms = (trio.current_time() - started) * 1000
        try:
            if not provider.supports_share:
                # Nothing was written into the region: the file route costs no second prefill.
                why = f"provider {provider.name} cannot write a shared region"
                return await self._failed(slot, Step.SHARE_HANDSHAKE, Reason.SHARE_UNSUPPORTED, why, share_ms=share_ms)
            job = ShareJob(
                req, self.model, self.n_ctx, tuple(tokens), region.share_id, region.layout, tuple(region.fds)
            )
            done = await prefill(provider, job, timeout_s=timeout_s, where=" into the shared region")
            if done.reason is not None:
                return await self._failed(
                    slot, Step.SHARE_PREFILL, done.reason, done.why, prefill_ms=done.prefill_ms, share_ms=share_ms
                )
            refused = await decoder.adopt(self.client, slot, region.share_id, tokens)
            if refused is not None:
                why = f"{refused.what}: {refused.answer}"
                return await self._failed(
                    slot, Step.ADOPT, Reason.ADOPT_REFUSED, why, prefill_ms=done.prefill_ms, share_ms=share_ms
                )
            return Outcome(Route.SHARE, prefill_ms=done.prefill_ms, share_ms=share_ms, evaluated=done.evaluated)
        except BaseException:
            # Abandoned after the handshake (the client left, so Cancelled, often in the group the
            # provider's nursery wraps it in): the provider may have written rows over the slot's cells,
            # which the next request with a matching prefix would decode from.  Re-raised unchanged.
            with trio.CancelScope(shield=True), trio.move_on_after(_ERASE_ON_CANCEL_S):
                await self._erase(slot)
            raise
        finally:
            region.close()

    async def _failed(
        self, slot: int, step: Step, reason: Reason, why: str, *, share_ms: float, prefill_ms: float | None = None
    ) -> Outcome:
        """A share that failed after its handshake: the slot erased, and the step, reason and words."""
        await self._erase(slot)
        return Outcome(Route.SHARE, step, reason, why, prefill_ms=prefill_ms, share_ms=share_ms)

    async def _erase(self, slot: int) -> None:
        # The decoder lent this slot's cells; whatever a provider left there must not be decoded from.
        await erase_slot(self.client, slot, "a failed share")
