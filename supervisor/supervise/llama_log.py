"""llama.cpp's log lines, as llama-server writes them, and the level onebitd logs each at.

A line is ``<elapsed> <level letter> <component> <function>: <message>``, for example::

    1.14.070.548 I slot print_timing: id  0 | task 4497 | prompt eval time = ...
    0.00.247.567 W srv  llama_server: security: no API key is set ...

llama-server writes five to ten ``slot`` lines for every request it serves (which slot, the prompt's
timings, the release).  onebitd's route line already says, once per request, what they say; relaying
each of them at ``info`` cost a sixth of onebitd's CPU per short request (the profile in
docs/benchmarks.md).  They are logged at ``debug`` (``log.level = "debug"`` shows them); errors and
warnings from anything else keep their weight, and every other line (start-up, the model, the
listening address) stays at ``info``.  Lines in no llama.cpp format (another program) are ``info``.

A few warnings are llama-server's to its own operator and do not hold for a child of onebitd's
(``_NOT_OURS``): llama-server warns, at every start, that it has no API key and allows every CORS
origin, but onebitd's children listen on unix sockets in a 0700 directory, and the key and CORS
checks are onebitd's (``server.api_keys``, ``server.cors_origins``).  Those are ``info``.
"""

from __future__ import annotations

import logging
import re

_LINE = re.compile(r"\d+\.\d+\.\d+\.\d+ ([IWED]) (\S+)")
_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.INFO, "D": logging.DEBUG}
# The components whose lines are about one request, not about the server.
_PER_REQUEST = frozenset({"slot"})
# Warnings that say nothing true about a child of onebitd's (a unix socket behind onebitd's checks).
_NOT_OURS = ("security: no API key is set and CORS allows all origins",)


def level_of(line: str) -> int:
    """The level to log one line of a child's output at."""
    found = _LINE.match(line)
    if found is None:
        return logging.INFO
    letter, component = found.groups()
    if letter != "E" and component in _PER_REQUEST:
        return logging.DEBUG
    if letter == "W" and any(words in line for words in _NOT_OURS):
        return logging.INFO
    return _LEVELS[letter]
