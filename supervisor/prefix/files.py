"""The prefix store's files: the on-disk format, the crash-safe write, and the scan at open.

An entry ``K`` (:func:`~supervisor.prefix.index.token_key` of its tokens) is two files in the store
directory::

    K.state   the llama.cpp slot state file, byte for byte as llama-server saved it
    K.json    the sidecar: {"format", "tokens", "fingerprint", "state_bytes", "blake2b", "created", "host"}

In a store the hosts share, ``K`` is ``<token key>~<host id>~<nonce>`` (supervisor/prefix/shared.py):
no two writes, of one host or of two, ever make the same name.  ``host`` is the writer's
``server.host_id`` (absent in sidecars written before it was).  ``blake2b`` is the state file's
content hash (:func:`digest`, hex), taken before the sidecar is written and checked before each
restore (:func:`matches`): a state file whose bytes changed under a committed sidecar (a lost write
on a server that acknowledged it, a bad disk) is never restored.  A sidecar without one (written by
an older onebitd) is not an entry: a private store drops it at open, a shared one leaves it to the
host that wrote it.

Writing one: the state file goes to ``.tmp-K-<random>.state`` (renamed in from the same file system,
else copied) and is fsynced, then renamed to ``K.state``; the sidecar is written and fsynced the
same way and renamed last: **the sidecar is the commit marker**.  Then the directory is fsynced.  A
crash at any point leaves either a committed entry or files :func:`scan` removes at the next open.
The sidecar is never rewritten: when an entry was last used is its state file's mtime.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..llama import statefile
from ..supervise import lockfile
from .index import token_key

log = logging.getLogger("onebit.prefix")

FORMAT = 1
FOREIGN = "made by another model, llama-server or [model] setting (fingerprint differs)"
UNHASHED = "written without a content hash (by an older onebitd)"
# The content hash's size: 128 bits tell a damaged file from the one saved (this is no defence
# against someone who may write the directory: they could rewrite the sidecar too).
DIGEST_BYTES = 16
# What a digest reads at a time: large enough that the hash, not the system calls, sets the pace.
DIGEST_CHUNK = 1 << 20
TEMP_PREFIX = ".tmp-"
STATE = ".state"
SIDECAR = ".json"


@attrs.frozen
class Entry:
    """One committed entry, as :class:`~supervisor.prefix.store.PrefixStore` hands it out."""

    key: str
    tokens: tuple[int, ...]
    state_bytes: int  # the state file's size
    disk_bytes: int  # state file and sidecar: what counts against max_bytes
    created: float  # seconds since the epoch
    last_used: float
    origin_host: str | None = None  # the server.host_id that stored it (None: written before hosts had one)
    blake2b: str = ""  # the state file's content hash (digest), hex

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


# A sidecar holds a prompt's token ids, a state file its KV: other local users read neither,
# whatever the umask (and whatever mode llama-server saved the state file with).
FILE_MODE = 0o600
DIR_MODE = 0o700


class Disk:
    """The writes the store makes, as one seam: a test stands in a subclass that fails them."""

    def move_in(self, source: Path, target: Path) -> None:
        """``source`` becomes ``target`` (a new name), durably: renamed on one file system, else
        copied; readable by us alone."""
        try:
            os.rename(source, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.copyfile(source, target)
        os.chmod(target, FILE_MODE)
        self.fsync(target)

    def write(self, target: Path, data: bytes) -> None:
        """A new file holding ``data``, durably, readable by us alone."""
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        with open(fd, "wb") as out:
            os.fchmod(fd, FILE_MODE)  # the umask may have taken bits away, never added any
            out.write(data)
            out.flush()
            os.fsync(fd)

    def fsync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def state_path(directory: Path, key: str) -> Path:
    return directory / f"{key}{STATE}"


def sidecar_path(directory: Path, key: str) -> Path:
    return directory / f"{key}{SIDECAR}"


def digest(path: Path) -> str:
    """The content hash of the file at ``path`` (blake2b, hex), read a chunk at a time: in a worker
    thread (hashlib lets go of the GIL while it hashes)."""
    with open(path, "rb") as source:
        return hashlib.file_digest(source, lambda: hashlib.blake2b(digest_size=DIGEST_BYTES)).hexdigest()


def matches(path: Path, expected: str) -> bool:
    """Whether the file at ``path`` holds what its sidecar's hash says (a file gone does not)."""
    try:
        return digest(path) == expected
    except OSError:
        return False


class Verified:
    """The state files a directory has hashed and found whole in this process, each by its inode and
    size (not its times: a use moves the mtime, the LRU clock): a file is hashed at its first restore
    after a start, and again once it is another file or another length (a rename over it, a
    truncation), not at every restore (a hash reads the whole file: 0.20-0.24 s per 100 MiB on the
    reference machine, against a restore of a few tens of ms).  What it does not see: bytes changed in
    place, same inode and length, while this process runs (they are found at the next start).  A
    directory's own; :meth:`matches` runs in a worker thread, and a dict's get and set are each
    atomic there."""

    def __init__(self) -> None:
        self._seen: dict[Path, tuple[int, int, str]] = {}

    def matches(self, path: Path, expected: str) -> bool:
        try:
            status = path.stat()
        except OSError:
            return False
        stamp = (status.st_ino, status.st_size, expected)
        if self._seen.get(path) == stamp:
            return True
        whole = matches(path, expected)
        if whole:
            self._seen[path] = stamp
        else:
            self._seen.pop(path, None)
        return whole

    def forget(self, path: Path) -> None:
        self._seen.pop(path, None)


def render_sidecar(
    tokens: tuple[int, ...],
    fingerprint: Mapping[str, Any],
    state_bytes: int,
    created: float,
    host: str | None = None,
    *,
    blake2b: str,
) -> bytes:
    document: dict[str, Any] = {
        "format": FORMAT,
        "tokens": list(tokens),
        "fingerprint": fingerprint,
        "state_bytes": state_bytes,
        "blake2b": blake2b,
        "created": created,
    }
    if host is not None:
        document["host"] = host
    return json.dumps(document, separators=(",", ":")).encode()


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("prefix store: cannot remove %s: %s", path, exc.strerror or exc)


def remove(directory: Path, key: str) -> None:
    """Remove an entry: the sidecar first (uncommitted from then on), then the state file."""
    _unlink(sidecar_path(directory, key))
    _unlink(state_path(directory, key))


def write_entry(disk: Disk, directory: Path, key: str, source: Path, sidecar: bytes, state_bytes: int) -> None:
    """Commit ``source`` as entry ``key`` (see the module docstring); raises OSError, leaving no file."""
    suffix = os.urandom(4).hex()
    temp_state = directory / f"{TEMP_PREFIX}{key}-{suffix}{STATE}"
    temp_sidecar = directory / f"{TEMP_PREFIX}{key}-{suffix}{SIDECAR}"
    final_state = state_path(directory, key)
    committed = False
    try:
        disk.move_in(source, temp_state)
        size = temp_state.stat().st_size
        if size != state_bytes or not statefile.has_magic(temp_state):
            raise OSError(errno.EINVAL, f"not the llama.cpp state file it was ({size} bytes)")
        os.rename(temp_state, final_state)
        disk.write(temp_sidecar, sidecar)
        os.rename(temp_sidecar, sidecar_path(directory, key))
        committed = True
        disk.fsync(directory)
    except OSError:
        if committed:
            remove(directory, key)
        else:
            _unlink(final_state)
        _unlink(temp_state)
        _unlink(temp_sidecar)
        raise


@attrs.frozen
class Scan:
    entries: list[Entry]  # least recently used first
    dropped: int


def token_part(key: str) -> str:
    """The token key an entry's name starts with (the whole name in a private store)."""
    return key.split("~", 1)[0]


def read_entry(directory: Path, key: str, fingerprint: Mapping[str, Any]) -> Entry | str:
    """The committed entry ``key``, or why it is not one (a file gone meanwhile included)."""
    sidecar = sidecar_path(directory, key)
    try:
        raw = sidecar.read_bytes()
        document = json.loads(raw)
    except (OSError, ValueError) as exc:
        return f"unreadable sidecar ({exc})"
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return "unknown sidecar format"
    tokens = document.get("tokens")
    state_bytes = document.get("state_bytes")
    created = document.get("created")
    if (
        not isinstance(tokens, list)
        or not all(type(t) is int for t in tokens)
        or not isinstance(state_bytes, int)
        or not isinstance(created, int | float)
    ):
        return "malformed sidecar"
    try:
        if token_key(tokens) != token_part(key):
            return "sidecar tokens do not match its name"
    except (OverflowError, TypeError):
        return "malformed sidecar"
    if document.get("fingerprint") != fingerprint:
        return FOREIGN
    blake2b = document.get("blake2b")
    if not isinstance(blake2b, str):
        return UNHASHED
    host = document.get("host")
    state = state_path(directory, key)
    try:
        stat = state.stat()
        magic = statefile.has_magic(state)
    except OSError:
        return "torn: no state file"
    if stat.st_size != state_bytes:
        return f"torn: state file has {stat.st_size} bytes, sidecar says {state_bytes}"
    if not magic:
        return "corrupt: not a llama.cpp state file"
    return Entry(
        key=key,
        tokens=tuple(tokens),
        state_bytes=state_bytes,
        disk_bytes=state_bytes + len(raw),
        created=float(created),
        last_used=stat.st_mtime,
        origin_host=host if isinstance(host, str) else None,
        blake2b=blake2b,
    )


def scan(directory: Path, fingerprint: Mapping[str, Any]) -> Scan:
    """The committed entries of ``directory``; everything else of ours is removed, one log line each.

    Files that are none of ours (another name pattern) are left alone.
    """
    names = {path.name for path in directory.iterdir()}
    _make_private(directory, names)
    entries: list[Entry] = []
    dropped = 0
    for name in sorted(names):
        path = directory / name
        if name.startswith(TEMP_PREFIX):
            log.info("prefix store: removing %s: a write that never finished", name)
            _unlink(path)
            dropped += 1
        elif name.endswith(SIDECAR):
            key = name[: -len(SIDECAR)]
            found = read_entry(directory, key, fingerprint)
            if isinstance(found, Entry):
                entries.append(found)
            else:
                log.info("prefix store: dropping entry %s: %s", key, found)
                remove(directory, key)
                dropped += 1
        elif name.endswith(STATE) and name[: -len(STATE)] + SIDECAR not in names:
            log.info("prefix store: removing %s: a state file without its sidecar (never committed)", name)
            _unlink(path)
            dropped += 1
    entries.sort(key=lambda entry: entry.last_used)
    return Scan(entries, dropped)


def touch(directory: Path, key: str, when: float) -> None:
    """Record a use: the state file's mtime (best effort; the order in memory is what counts now)."""
    try:
        os.utime(state_path(directory, key), (when, when))
    except OSError as exc:
        log.debug("prefix store: cannot record a use of %s: %s", key, exc.strerror or exc)


def _make_private(directory: Path, names: set[str]) -> None:
    """Entries an older onebitd wrote under a permissive umask become ours alone."""
    for name in names:
        if name.endswith((STATE, SIDECAR)):
            path = directory / name
            try:
                if os.lstat(path).st_mode & 0o077:
                    os.chmod(path, FILE_MODE)
            except OSError as exc:
                log.warning("prefix store: cannot make %s private: %s", name, exc.strerror or exc)


def probe(disk: Disk, directory: Path, host: str = "") -> None:
    """Make ``directory`` if need be (ours alone: 0700) and prove it writable; raises OSError.
    ``host``: in a shared directory, the probe's name says whose it is."""
    directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    try:
        os.chmod(directory, DIR_MODE)  # mkdir's mode is under the umask, and the directory may be older
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise  # the one line the store's opening logs says it
        log.warning("prefix store: cannot make %s private (0700): %s", directory, exc.strerror or exc)
    probe_file = directory / f"{TEMP_PREFIX}probe-{host}{'~' if host else ''}{os.getpid()}-{time.monotonic_ns()}"
    disk.write(probe_file, b"")
    probe_file.unlink()


def lock(disk: Disk, directory: Path) -> tuple[Path, int]:
    """Make and probe the directory, and hold its lock (one onebitd per store): its absolute path
    and the lock's fd."""
    directory = directory.absolute()
    probe(disk, directory)
    try:
        return directory, lockfile.hold(directory / ".lock")
    except lockfile.LockHeld:
        raise OSError("in use by another onebitd (its .lock is held)") from None


def discard(path: Path) -> None:
    """The file put_file was handed, when it did not move into the store (a tmpfs: no thread)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def remove_all(directory: Path, keys: list[str]) -> None:
    for key in keys:
        remove(directory, key)
