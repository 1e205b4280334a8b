"""HTTP/1.1 framing for both ends of onebitd, without I/O: llhttp parses, onebitd's rules decide.

Readers (:mod:`.readers`, over :mod:`.reading`): :class:`RequestReader` takes the bytes a client sends
the front; :class:`ResponseReader` the bytes llama-server sends the decoder client.  Both are fed bytes
as they come (``feed``) and hand out events in stream order (``next_event``): a :class:`RequestHead` or
:class:`ResponseHead`, ``bytes`` of its body, :data:`END` at the end of each message, and
:data:`NEED_DATA` when what was fed is used up.  What is not HTTP as onebitd takes it is one error,
:class:`Malformed`, raised by ``next_event`` where it stands in the stream, after every event before it.

Writers (:mod:`.writers`): the front's response heads, chunks, and whether a connection is kept after
a response (:class:`~.writers.Close`, the one table of reasons to close).

llhttp (Node.js's parser, through ``httptools``) checks the grammar: tokens, CRLF line ends (no bare
LF or CR), no obs-fold, no control characters in values, chunk sizes and extensions, trailers, one
Content-Length and not with Transfer-Encoding.  What it allows and onebitd does not is checked here:
exactly one Host on HTTP/1.1, Transfer-Encoding only ``chunked`` alone and only on 1.1, lengths of at
most 18 digits, versions 1.0 and 1.1, the request target's forms, CONNECT, an Upgrade with a body.
"""

from ...errors import Malformed
from .readers import RequestReader, ResponseReader
from .reading import (
    END,
    MAX_BLANK_BYTES,
    MAX_CHUNK_LINE,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_LENGTH_DIGITS,
    MAX_TRAILER_BYTES,
    NEED_DATA,
    Event,
    RequestHead,
    ResponseHead,
    tokens,
)

__all__ = [
    "END",
    "MAX_BLANK_BYTES",
    "MAX_CHUNK_LINE",
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "MAX_LENGTH_DIGITS",
    "MAX_TRAILER_BYTES",
    "NEED_DATA",
    "Event",
    "Malformed",
    "RequestHead",
    "RequestReader",
    "ResponseHead",
    "ResponseReader",
    "tokens",
]
