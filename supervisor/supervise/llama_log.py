"""llama.cpp's log lines, as llama-server writes them, and the level onebitd logs each at.

A line is ``<elapsed> <level letter> <component> <function>: <message>``, for example::

    1.14.070.548 I slot print_timing: id  0 | task 4497 | prompt eval time = ...
    0.00.247.567 W srv  llama_server: security: no API key is set ...

:func:`level_of` is a line's own level: the letter llama.cpp marked it with (``E`` error, ``W``
warning, ``I`` info, ``D`` debug), with three exceptions:

- llama-server writes five to ten ``slot`` lines for every request it serves (which slot, the
  prompt's timings, the release).  onebitd's route line already says, once per request, what they
  say, so they are ``debug`` unless they are errors.
- A few warnings are llama-server's to its own operator and cannot hold for a child of onebitd's
  (``NOT_OURS``): llama-server warns at every start that it has no API key and allows every CORS
  origin, but onebitd's children listen on unix sockets in a 0700 directory, and the key and CORS
  checks are onebitd's (``server.api_keys``, ``server.cors_origins``).  They are ``debug``.
- A line with no mark (another program's, ggml's before llama-server set up its log, an assertion's
  message) is ``info``: nothing says it is more.

:func:`relayed_level` is the level onebitd logs a line at: its own when it is at least
``log.children`` (``warning`` by default, so an operator's log has the children's warnings and
errors and none of the hundreds of lines of a model's load), else ``debug`` (``log.level = "debug"``
shows every line).  Every line, whatever its level, is kept in its child's recent lines
(``onebitctl logs``).
"""

from __future__ import annotations

import logging
import re

_LINE = re.compile(r"\d+\.\d+\.\d+\.\d+ ([IWED]) (\S+)")
_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.INFO, "D": logging.DEBUG}
# log.children's values: the config's validator holds it to these.
CHILDREN_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# The components whose lines are about one request, not about the server.
_PER_REQUEST = frozenset({"slot"})
# Warnings that say nothing true about a child of onebitd's (a unix socket behind onebitd's checks).
NOT_OURS = ("security: no API key is set and CORS allows all origins",)

# log.children, as observe/logs.py's setup last set it: the daemon's one logging configuration.
_children = logging.WARNING


def set_children_level(name: str) -> None:
    """``log.children``: a child's lines below this level are logged at ``debug``."""
    global _children
    _children = CHILDREN_LEVELS[name]


def level_of(line: str) -> int:
    """One line's own level, as llama.cpp marked it (less for the lines that say less)."""
    found = _LINE.match(line)
    if found is None:
        return logging.INFO
    letter, component = found.groups()
    if letter != "E" and component in _PER_REQUEST:
        return logging.DEBUG
    if letter == "W" and any(words in line for words in NOT_OURS):
        return logging.DEBUG
    return _LEVELS[letter]


def relayed(level: int) -> int:
    """The level to log a line of a child's output at, given its own: that from ``log.children``
    up, else debug."""
    return level if level >= _children else logging.DEBUG


def relayed_level(line: str) -> int:
    """The level to log one line of a child's output at."""
    return relayed(level_of(line))
