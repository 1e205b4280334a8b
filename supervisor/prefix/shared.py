"""A prefix store directory the hosts share: its names, its listing, and eviction without locks.

Several onebitd (each its own ``server.host_id``) use one directory, typically an NFS mount.  No lock
is held across hosts (``flock`` and NFS byte-range locks are advisory, and lost with a client's
lease); instead:

- **No name is ever made twice.**  An entry is ``<token key>~<host>~<nonce>`` (``.state`` and
  ``.json``), its temporary files ``.tmp-<that>-<random>``: two hosts storing the same prompt make two
  entries, and no write or removal can meet another's file by name.  The sidecar is renamed in last
  (supervisor/prefix/files.py), and ``rename`` is atomic on NFS too: a reader sees a committed entry,
  or none.
- **One host removes an entry, whoever else chose it.**  Removal first renames the sidecar to a
  tombstone name of the remover's own (``.tomb-<entry>-<host>-<random>.json``): exactly one rename
  succeeds; the others get ENOENT and know that another host took it.  The winner then renames the
  state file the same way and unlinks both.
- **Nothing is trusted from memory for others' entries.**  :func:`listing` reads the directory again;
  any file may vanish between the listing and the stat or read that follows, and is then not an entry.
- **What a dead host left** (a temporary file, a tombstone, a state file never committed, an entry
  no one used) is removed by whichever host sees it past ``max_age_s``: a write or a removal takes
  seconds, so a file that old is no one's work in progress.  A host's own leftovers (their names
  say whose they are: :func:`leftover_of`) it removes at its start, whatever their age: none of its
  work is in progress then.  Until they are removed, leftovers count against ``max_bytes``.
- **Ages on the directory's clock**, not the host's: ``now`` is the mtime the file system gives a
  file made for the purpose (an NFS server stamps its own time), and uses are recorded with the
  server's time too (``utime`` to now), so a host whose clock is minutes off neither removes a live
  host's work in progress nor keeps what is old.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from . import files as prefix_files
from .directory import Listed as Listed
from .directory import Listing as Listing
from .files import SIDECAR, STATE, TEMP_PREFIX, Entry

log = logging.getLogger("onebit.prefix")

TOMB_PREFIX = ".tomb-"
SEPARATOR = "~"


def entry_name(key: str, host: str) -> str:
    """A new entry's name for the token key ``key``, written by ``host``."""
    return f"{key}{SEPARATOR}{host}{SEPARATOR}{os.urandom(4).hex()}"


def host_of(name: str) -> str | None:
    """The host an entry's name says wrote it (None: not a shared entry's name)."""
    parts = name.split(SEPARATOR)
    return parts[1] if len(parts) == 3 else None


def _age(path: Path, now: float) -> float | None:
    """How long ago ``path`` was last changed; None when it is gone."""
    try:
        return now - os.lstat(path).st_mtime
    except FileNotFoundError:
        return None


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("prefix store: cannot remove %s: %s", path.name, exc.strerror or exc)
        return False
    return True


def evict(directory: Path, name: str, host: str) -> bool:
    """Remove entry ``name`` if no other host does: True when we removed it, False when it was gone
    (another host took it first).  Raises no OSError but for the directory itself being lost."""
    tomb = f"{TOMB_PREFIX}{name}{SEPARATOR}{host}{SEPARATOR}{os.urandom(4).hex()}"
    try:
        os.rename(prefix_files.sidecar_path(directory, name), directory / f"{tomb}{SIDECAR}")
    except FileNotFoundError:
        return False
    # Uncommitted now, and ours alone: no other host renames or reads it from here on.
    try:
        os.rename(prefix_files.state_path(directory, name), directory / f"{tomb}{STATE}")
    except FileNotFoundError:
        pass
    else:
        _unlink(directory / f"{tomb}{STATE}")
    _unlink(directory / f"{tomb}{SIDECAR}")
    return True


def leftover_of(name: str) -> str | None:
    """The host whose unfinished work a file's name says it is: a temporary file's writer (an
    entry's, a probe's, a clock reading's), a tombstone's remover, an uncommitted state file's
    writer (None: no host named)."""
    if name.startswith(TOMB_PREFIX):
        parts = name.split(SEPARATOR)  # .tomb-<key>, its writer, its nonce, the remover, <random>.<ext>
        return parts[3] if len(parts) == 5 else None
    if name.startswith(TEMP_PREFIX):
        rest = name[len(TEMP_PREFIX) :]
        for word in ("probe-", "clock-"):
            if rest.startswith(word):
                return rest[len(word) :].split(SEPARATOR)[0]
        parts = rest.split(SEPARATOR)  # <key>, its writer, <nonce>-<random>.<ext>
        return parts[1] if len(parts) == 3 else None
    return host_of(name[: -len(STATE)]) if name.endswith(STATE) else None


def _leftover(path: Path, *, now: float, max_age_s: float, own: bool, what: str) -> int:
    """A file no entry owns: removed when older than ``max_age_s`` or ``own`` (this host's, at its
    start); else its size, which counts against the budget (-1: removed, 0: gone meanwhile)."""
    try:
        stat = os.lstat(path)
    except FileNotFoundError:
        return 0
    age = now - stat.st_mtime
    if (own or age > max_age_s) and _unlink(path):
        log.info("prefix store: removing %s: %s (left %.0f s ago)", path.name, what, age)
        return -1
    return stat.st_size


def listing(
    directory: Path,
    fingerprint: Mapping[str, Any],
    *,
    known: Mapping[str, Entry],
    foreign: frozenset[str],
    host: str,
    max_age_s: float,
    now: float,
    at_start: bool = False,
) -> Listing:
    """The shared directory as it is now (in a worker thread): committed entries, ours read (``known``
    ones are not read again, only their use times), others' sized; leftovers and aged entries past
    ``max_age_s`` removed, and ``at_start`` this host's leftovers whatever their age.  Raises OSError
    only when the directory itself cannot be listed."""
    names = set(os.listdir(directory))
    entries: dict[str, Entry] = {}
    listed: list[Listed] = []
    others: set[str] = set()
    cleaned = aged = leftovers = 0
    for name in sorted(names):
        path = directory / name
        uncommitted = name.endswith(STATE) and name[: -len(STATE)] + SIDECAR not in names
        if name.startswith((TEMP_PREFIX, TOMB_PREFIX)) or uncommitted:
            own = at_start and leftover_of(name) == host
            what = "a state file never committed" if uncommitted else "a write or removal that never finished"
            size = _leftover(path, now=now, max_age_s=max_age_s, own=own, what=what)
            if size < 0:
                cleaned += 1
            else:
                leftovers += size
            continue
        if name.endswith(STATE):
            continue
        if not name.endswith(SIDECAR) or host_of(name[: -len(SIDECAR)]) is None:
            continue  # none of ours (a private store's entry does not belong here)
        stem = name[: -len(SIDECAR)]
        try:
            state = os.stat(prefix_files.state_path(directory, stem))
            sidecar_bytes = os.stat(path).st_size
        except FileNotFoundError:
            # Being removed (or torn by hand): not an entry; past the age, whoever sees it removes it.
            age = _age(path, now)
            if age is not None and age > max_age_s and evict(directory, stem, host):
                cleaned += 1
            continue
        if now - state.st_mtime > max_age_s:
            if evict(directory, stem, host):
                log.info("prefix store: evicting entry %s: unused for %.0f s", stem, now - state.st_mtime)
                aged += 1
            continue
        ours = False
        if stem in foreign:
            others.add(stem)
        elif stem in known:
            entries[stem] = attrs.evolve(known[stem], last_used=state.st_mtime)
            ours = True
        else:
            found = prefix_files.read_entry(directory, stem, fingerprint)
            if isinstance(found, Entry):
                entries[stem] = found
                ours = True
            elif found in (prefix_files.FOREIGN, prefix_files.UNHASHED):
                others.add(stem)  # another host's build, model or older onebitd: its own to restore, never ours
            else:
                continue  # vanished or half seen: the next listing tells
        listed.append(Listed(stem, state.st_size + sidecar_bytes, state.st_mtime, ours))
    listed.sort(key=lambda item: item.last_used)
    return Listing(entries, listed, cleaned, aged, frozenset(others), leftovers)


def choose_victims(listed: list[Listed], need: int, max_bytes: int, pinned: set[str]) -> list[str] | None:
    """The least recently used entries (any host's, any fingerprint's; not ``pinned``) whose removal
    leaves room for ``need`` more bytes within ``max_bytes``; None when pins prevent it."""
    total = sum(item.disk_bytes for item in listed)
    if total + need <= max_bytes:
        return []
    victims: list[str] = []
    for item in listed:
        if item.name in pinned:
            continue
        victims.append(item.name)
        total -= item.disk_bytes
        if total + need <= max_bytes:
            return victims
    return None


def is_unreachable(exc: OSError) -> bool:
    """Whether an error says the shared directory itself is gone (a lost mount, a stale handle)."""
    return exc.errno in {errno.ENOENT, errno.ESTALE, errno.EIO, errno.ENOTDIR, errno.EACCES, errno.ENOTCONN}
