"""The prefix store's lookup: which stored token sequence is the longest prefix of a prompt.

Pure and in memory.  Every entry is filed under the hash chain of its tokens up to its last full
block of :data:`BLOCK` tokens (its *anchor*), then under the tokens past it (its *tail*).  A prompt's
chain is read at every block boundary; the anchors it passes through, deepest first, and a dict read
of the prompt's own tokens at each tail length there, give the only entries that can be its prefix.
The answer is then checked token by token, so a hash collision can cost time, never a wrong answer.
A 4k-token prompt is 64 hashes and a few dictionary reads, whatever the number of entries.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Tokens per block: small enough that an entry's tail past its anchor (compared token by token) is
# short, large enough that a long prompt costs few hashes.  llama.cpp's own KV cells are not blocked,
# so nothing outside this module depends on it.
BLOCK = 64


def token_key(tokens: Sequence[int]) -> str:
    """A stable name for exactly these tokens (as int32, llama_token): the store's file names and its
    de-duplication key.  Raises OverflowError or TypeError for what cannot be llama.cpp tokens."""
    return hashlib.sha256(array("i", tokens).tobytes()).hexdigest()[:32]


def _anchors(tokens: tuple[int, ...], n_blocks: int) -> list[int]:
    """The hash chain after 0, 1, ..., ``n_blocks`` whole blocks of ``tokens``.

    Python's own tuple hash (no bytes to build: a third of the cost of hashlib here); it is stable
    for ints across runs, and the index lives in memory only anyway.
    """
    running = 0
    found = [running]
    for k in range(n_blocks):
        running = hash((running, tokens[k * BLOCK : (k + 1) * BLOCK]))
        found.append(running)
    return found


def _verified(prompt: tuple[int, ...], stored: tuple[int, ...]) -> bool:
    """The exact check behind every answer (a seam: tests count its calls)."""
    return prompt[: len(stored)] == stored


class PrefixIndex:
    """Token sequences by key, answering "the longest one that is a prefix of this prompt"."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._anchor_of: dict[str, int] = {}
        # anchor -> tail length -> tail (the tokens past the anchor) -> keys.  Entries behind
        # one shared system prompt share its anchor; their tails tell them apart in a dict read.
        self._by_anchor: dict[int, dict[int, dict[tuple[int, ...], list[str]]]] = {}
        self._deepest = 0  # the most whole blocks any entry has: no hash past it is worth computing

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._tokens

    def add(self, key: str, tokens: Sequence[int]) -> None:
        """File ``tokens`` under ``key`` (a key already present is left as it is)."""
        if key in self._tokens:
            return
        stored = tuple(tokens)
        n_blocks = len(stored) // BLOCK
        anchor = _anchors(stored, n_blocks)[-1]
        tail = stored[n_blocks * BLOCK :]
        self._tokens[key] = stored
        self._anchor_of[key] = anchor
        by_length = self._by_anchor.setdefault(anchor, {})
        by_tail = by_length.setdefault(len(tail), {})
        by_tail.setdefault(tail, []).append(key)
        # Longest tails first: the first verified candidate at an anchor is its longest.
        self._by_anchor[anchor] = dict(sorted(by_length.items(), reverse=True))
        self._deepest = max(self._deepest, n_blocks)

    def remove(self, key: str) -> None:
        """Forget ``key``; an unknown key is ignored."""
        if key not in self._tokens:
            return
        stored = self._tokens.pop(key)
        anchor = self._anchor_of.pop(key)
        tail = stored[(len(stored) // BLOCK) * BLOCK :]
        by_length = self._by_anchor[anchor]
        by_tail = by_length[len(tail)]
        by_tail[tail].remove(key)
        if not by_tail[tail]:
            del by_tail[tail]
        if not by_tail:
            del by_length[len(tail)]
        if not by_length:
            del self._by_anchor[anchor]
        if not self._by_anchor:
            self._deepest = 0

    def longest_prefix(self, prompt: Sequence[int]) -> str | None:
        """The key of the longest stored sequence that ``prompt`` starts with, or None.

        A sequence equal to the whole prompt counts.
        """
        if not self._tokens:
            return None
        whole = tuple(prompt)
        anchors = _anchors(whole, min(len(whole) // BLOCK, self._deepest))
        n_blocks = len(anchors) - 1
        for depth in range(n_blocks, -1, -1):
            by_length = self._by_anchor.get(anchors[depth])
            if by_length is None:
                continue
            start = depth * BLOCK
            for length, by_tail in by_length.items():
                if start + length > len(whole):
                    continue
                for key in by_tail.get(whole[start : start + length], ()):
                    if _verified(whole, self._tokens[key]):
                        return key
        return None
