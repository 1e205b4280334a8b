"""The one exception tree of onebit.  Names say who is at fault.

    OnebitError
    ├── ConfigError            our configuration: a file, a key path, what is wrong
    ├── ChildError             a supervised child process could not be started or kept alive
    ├── RuntimeDirInUse        another onebitd holds the runtime directory's lock
    ├── ListenError            an address of server.host cannot be listened on (not this machine's, in use)
    ├── DecoderError           the decoder (llama-server) misbehaved
    │   ├── DecoderUnavailable     not ready, failed, or could not be reached (HTTP 503)
    │   └── DecoderProtocolError   answered, but not with what its contract says (HTTP 502)
    ├── ProviderError          a prefill provider failed its job
    │   └── ProviderStateRefused   the decoder refused the state it wrote (the restore failed): its
    │                              files do not fit this decoder, however often it is asked
    ├── ShareRefused           the decoder would not lend its KV (the share handshake failed)
    ├── AdminError             an admin verb refused (its message and extra fields go to onebitctl)
    ├── AdminUnavailable       no onebitd answers on the admin socket
    ├── PrefixStoreError       the prefix store cannot hand over an entry (gone, or not exposable):
    │                          the request goes on as if there were none
    ├── ChatFormRefused        an Anthropic or Responses body llama-server's conversion to chat form
    │                          refuses (llama/chatform.py): sent on as it is, the decoder answers it
    └── ClientError            the HTTP client sent something we refuse (HTTP 4xx)
        ├── Malformed              bytes that are not HTTP/1.1 as onebitd takes it (framing.py: 400,
        │                          431, 501, 505); from llama-server, wire.py makes it DecoderUnavailable
        └── Overloaded             every slot busy and the queue full (HTTP 503)

Foreign exceptions are translated into this tree at exactly one seam each: llhttp's (httptools')
parse errors in ``http/framing/``; the decoder socket's and a malformed reply in ``http/wire.py``;
OSError from process spawning in ``supervise/process.py``, from binding in ``http/server.py``, from the
admin socket in ``admin/verbs.py``; a config file's (unreadable, not TOML, not the schema) in
``config/convert.py``.  Errors that
stay inside one module are not in the tree: a slot state file that does not parse
(``statefile.StateFileError``, a ValueError) and the prefix store's file system (the store turns
itself off, one log line) are handled where they happen, and a share worker's refusal is its own
program's.  httpx is for clients beside onebitd (``testing.unix_transport``): its errors are theirs.
"""

from __future__ import annotations


class OnebitError(Exception):
    """Root of every error onebit raises on purpose."""


class ConfigError(OnebitError):
    """The configuration is wrong.  ``lines`` holds one ``file: key.path: what`` line per problem."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


class ChildError(OnebitError):
    """A child process could not be spawned."""


class DecoderError(OnebitError):
    """The decoder did not do what we asked.  ``status`` is the HTTP status we answer with.

    ``message`` is for onebitd's operator (the log, the route line): it may name the decoder's
    socket and an errno.  ``public`` is what a client is told: words, no internals."""

    status = 502
    code = "decoder_error"
    public = "the decoder failed on this request; see onebitd's log"

    def __init__(self, message: str, *, upstream_status: int | None = None, public: str | None = None) -> None:
        self.message = message
        self.upstream_status = upstream_status
        if public is not None:
            self.public = public
        super().__init__(message)


class DecoderUnavailable(DecoderError):
    """The decoder is loading, restarting, failed, or did not answer."""

    status = 503
    code = "decoder_unavailable"
    public = "the decoder could not be reached (it may be restarting); try again shortly"


class DecoderProtocolError(DecoderError):
    """The decoder answered something its contract does not allow."""

    status = 502
    code = "decoder_bad_reply"
    public = "the decoder answered something onebitd cannot relay; see onebitd's log"


class ProviderError(OnebitError):
    """A prefill provider failed a job (crash, exit status, timeout, refused)."""


class ProviderAnswered(ProviderError):
    """A provider answered a job with an error of its own (an HTTP 4xx or 5xx: a model its engine
    cannot compute), not a lost connection: a start-time check refuses it rather than trying again."""


class ProviderStateRefused(ProviderError):
    """The decoder refused to restore what a provider wrote: a start-time check refuses the provider
    rather than trying again."""


class PrefixStoreError(OnebitError):
    """A prefix store entry could not be handed to the decoder; the store itself stays usable."""


class ChatFormRefused(OnebitError):
    """A /v1/messages or /v1/responses body that llama-server would not convert into a chat request,
    in its words: onebitd has no prompt to route, and lets the decoder answer with its own error."""


class ClientError(OnebitError):
    """The client's request is refused: ``status`` and ``code`` go into the JSON error envelope."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: int | None = None) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        super().__init__(message)


class Malformed(ClientError):
    """Bytes that are not HTTP/1.1 as onebitd takes it (supervisor/http/framing/).  ``status`` and
    ``code`` are the front's answer (400, 431, 501, 505); the decoder client makes it ``DecoderUnavailable``."""


class Overloaded(ClientError):
    """Every slot is busy and the wait queue is full."""

    def __init__(self, message: str = "all decoder slots are busy and the queue is full") -> None:
        super().__init__(503, "overloaded", message, retry_after=1)


class RuntimeDirInUse(OnebitError):
    """Another onebitd holds the runtime directory: a second one would remove its sockets and files."""


class ListenError(OnebitError):
    """The front could not bind an address of ``server.host``; the message names the key."""


class ShareRefused(OnebitError):
    """The share handshake failed; ``reason`` is in the decoder's words where it said any.  Nothing
    was written into a region yet, so the request may still take the file route."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class AdminError(OnebitError):
    """An admin verb refused; ``extra`` fields (``lines``, ``remaining``) go into its answer."""

    def __init__(self, message: str, **extra: object) -> None:
        self.message = message
        self.extra = extra
        super().__init__(message)


class AdminUnavailable(OnebitError):
    """No daemon answers on the admin socket (not running, or the socket is not ours)."""
