"""A slot's KV lent out, as the share route's llama-server does (docs/protocol.md): one memfd per
region, mapped here so an adopt can read back the rows a provider wrote, and the header sent to
onebitd's socket with the fds.

The layout: n_layer 2, tensors cache_k_l<L> and cache_v_l<L>, row_bytes 16, align 4096, n_ctx the
slot's context; one region, or two (K and V apart), each a memfd sealed against resizing.  A provider
writes, for each of the job's tokens and each K/V tensor, the row :func:`expected_row` gives
(tests/fakes/fake_share_provider.py writes them).
With ``state`` the share is a hybrid model's: a last region stages its recurrent state, tensors
cache_r_l0 and cache_s_l0 (kinds ``r``, ``s``), one row each, which a provider writes as the row
:func:`expected_row` gives for the last token at the last position.
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import mmap
import os
import socket
import struct
from typing import Any


def expected_row(token: int, pos: int, tensor: str, row_bytes: int) -> bytes:
    """The bytes a provider writes for ``token`` at ``pos`` in ``tensor``: the token id, big-endian,
    then a hash of all three.  tests/fakes/fake_share_provider.py has the same function; they must agree."""
    seed = f"{tensor}:{pos}:{token}".encode()
    digest = b""
    while len(digest) < row_bytes - 4:
        digest += hashlib.sha256(seed + len(digest).to_bytes(4, "big")).digest()
    return token.to_bytes(4, "big") + digest[: row_bytes - 4]


# The share layout: small, so a region is a few pages.  Alignment as llama.cpp's (4 KiB).
SHARE_LAYERS = 2
SHARE_ROW_BYTES = 16
SHARE_ALIGN = 4096
# Each region sized once and sealed before it is sent, as the patched llama-server's are: no provider
# can resize it under the decoder's mapping.
REGION_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def _align(n: int) -> int:
    return -(-n // SHARE_ALIGN) * SHARE_ALIGN


class Share:
    """A slot's KV lent out: one memfd per region, mapped here so an adopt can read the rows back."""

    def __init__(self, share_id: str, slot: int, n_ctx: int, n_regions: int, *, state: bool = False) -> None:
        self.share_id = share_id
        self.slot = slot
        self.n_ctx = n_ctx
        self.tensors: list[dict[str, Any]] = []
        tensor_size = _align(n_ctx * SHARE_ROW_BYTES)
        sizes = [0] * n_regions
        for layer in range(SHARE_LAYERS):
            for kind in ("k", "v"):
                region = 0 if n_regions == 1 or kind == "k" else 1
                self.tensors.append(
                    {
                        "name": f"cache_{kind}_l{layer}",
                        "kind": kind,
                        "region": region,
                        "offset": sizes[region],
                        "row_bytes": SHARE_ROW_BYTES,
                    }
                )
                sizes[region] += tensor_size
        self.state_tensors: list[dict[str, Any]] = []
        if state:
            sizes.append(0)
            for kind in ("r", "s"):
                self.state_tensors.append(
                    {
                        "name": f"cache_{kind}_l0",
                        "kind": kind,
                        "region": len(sizes) - 1,
                        "offset": sizes[-1],
                        "row_bytes": SHARE_ROW_BYTES,
                        "stride": 0,
                    }
                )
                sizes[-1] += SHARE_ROW_BYTES
            sizes[-1] = _align(sizes[-1])
        regions: list[dict[str, Any]] = [{"size": size} for size in sizes]
        if state:
            regions[-1]["state"] = True
        self.header = {
            "share_id": share_id,
            "n_ctx": n_ctx,
            "n_layer": SHARE_LAYERS,
            "align": SHARE_ALIGN,
            "regions": regions,
            "tensors": self.tensors + self.state_tensors,
        }
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        try:
            for i, size in enumerate(sizes):
                fd = os.memfd_create(f"fake-kv-{share_id}-{i}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                self.fds.append(fd)
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REGION_SEALS)
                self.maps.append(mmap.mmap(fd, size))
        except BaseException:
            self.close()
            raise

    def written(self, pos: int) -> int | None:
        """What a provider wrote at ``pos``: its token (-1 for rows that are not a token's), or None."""
        rows = []
        for tensor in self.tensors:
            start = tensor["offset"] + pos * SHARE_ROW_BYTES
            rows.append(self.maps[tensor["region"]][start : start + SHARE_ROW_BYTES])
        if not any(any(row) for row in rows) or len(rows[0]) < SHARE_ROW_BYTES:
            return None
        token = int.from_bytes(rows[0][:4], "big")
        if all(
            row == expected_row(token, pos, t["name"], SHARE_ROW_BYTES)
            for row, t in zip(rows, self.tensors, strict=True)
        ):
            return token
        return -1

    def valid_tokens(self, n_tokens: int) -> list[int]:
        """The tokens whose rows are right in every tensor, from position 0 to the first that is not."""
        tokens: list[int] = []
        for pos in range(n_tokens):
            token = None
            for tensor in self.tensors:
                start = tensor["offset"] + pos * SHARE_ROW_BYTES
                row = self.maps[tensor["region"]][start : start + SHARE_ROW_BYTES]
                if len(row) < SHARE_ROW_BYTES:
                    return tokens
                if token is None:
                    token = int.from_bytes(row[:4], "big")
                if row != expected_row(token, pos, tensor["name"], SHARE_ROW_BYTES):
                    return tokens
            assert token is not None
            tokens.append(token)
        return tokens

    def state_written(self, tokens: list[int]) -> bool:
        """Whether every recurrent state row is the one for the last of ``tokens`` (the adopted cells)."""
        if not tokens:
            return False
        pos = len(tokens) - 1
        return all(
            self.maps[t["region"]][t["offset"] : t["offset"] + SHARE_ROW_BYTES]
            == expected_row(tokens[-1], pos, t["name"], SHARE_ROW_BYTES)
            for t in self.state_tensors
        )

    def close(self) -> None:
        for m in self.maps:
            m.close()
        for fd in self.fds:
            os.close(fd)
        self.maps, self.fds = [], []


def send_header(path: str, header: dict[str, Any], fds: list[int]) -> None:
    payload = json.dumps(header).encode()
    message = struct.pack(">I", len(payload)) + payload
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)  # onebitd accepts at once or has given up on the share
        try:
            sock.connect(path)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
            sent = sock.sendmsg([message], rights)
            sock.sendall(message[sent:])
        except OSError:
            pass  # it went away (the request was cancelled): the share is simply never adopted
