"""One client connection inside hypercorn (trio), hardened so that no connection can stop the front.

hypercorn 0.18's ``TCPServer`` serves one connection.  Two of its paths send on the socket: its
``protocol_send`` (under ``send_lock``) and its ``_close`` (``send_eof``, without the lock).  When
h11 finds a request malformed after the app has started on it (a broken chunk footer, say),
hypercorn sends a 400 of its own while the connection closes beside it, and trio raises
``BusyResourceError``: two tasks sending on one stream.  hypercorn lets that escape the connection's
handler, which runs in the nursery of every connection, so one bad request stopped the whole front
and with it onebitd (scripts/chaos's ``fuzz``, 600 cases, found it; hypercorn issue #203 is the
same escape).

:class:`Connection` changes two things, and nothing else:

- a send that finds the stream busy is a send to a closing connection: like a broken one, the
  protocol is told the connection is closed (what hypercorn does for ``BrokenResourceError``);
- anything else a connection raises is logged with its traceback and the connection closed: one
  client's connection is not the server.

:func:`install` puts it where hypercorn's trio worker looks for its connection class; ``Front.run``
calls it before it serves, and tests/test_front_limits.py checks both the effect and that hypercorn
still looks there.
"""

from __future__ import annotations

import contextlib
import logging

import hypercorn.trio.run
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.trio.tcp_server import TCPServer

log = logging.getLogger("onebit.front")


class Connection(TCPServer):
    async def run(self) -> None:
        try:
            await super().run()
        except Exception:  # hypercorn's or h11's, on one connection: close it, keep serving the rest
            log.warning("a client connection failed inside hypercorn; it was closed", exc_info=True)
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self.stream.aclose()

    async def protocol_send(self, event: Event) -> None:
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True):
                    await self.stream.send_all(event.data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                await self.protocol.handle(Closed())


def install() -> None:
    """hypercorn's trio worker builds each connection from its module's ``TCPServer``."""
    hypercorn.trio.run.TCPServer = Connection  # type: ignore[attr-defined]  # not re-exported; it is looked up there
