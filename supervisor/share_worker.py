"""A ``worker`` prefill provider for the share route that needs no patched provider: a stock
llama-server prefills, saves its slot to a file on tmpfs, and this program copies each position's K and
V rows out of that file into the region the decoder lent.

    python -m supervisor.share_worker LLAMA_SERVER [llama-server model args: -m ... -c ... -np ... -fa ...]

The model arguments must be the decoder's (``-m``, ``-c``, ``-np``, ``-b``, ``-ub``, ``-ctk``, ``-ctv``):
the rows are only the decoder's rows when both caches are alike.  The worker contract is docs/protocol.md's
(``ONEBIT_PROVIDER_FD``, one JSON line each way, ``{"ready": true}`` first); it serves file jobs too (the
share route falls back to them), by moving the saved file to ``state_file``.

The slot state file it parses is llama.cpp's ``llama_state_seq_save_file`` (``LLAMA_STATE_SEQ_VERSION``
4), little-endian:

    u32 magic 0x67677371 ('ggsq'), u32 version 4, u32 n_token, i32 token[n_token]
        (llama-server packs its prompt there: -1, 1 (its version), the count, the tokens, the media
        count, which must be 0; a list not starting with -1 is taken as the tokens themselves)
    u32 n_stream; per stream: u32 cell_count, and when cell_count > 0:
        per cell:  i32 pos, u32 n_seq_id (1), i32 seq_id
        u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
        per layer: i32 k_type, u64 k_row_bytes, k_row_bytes * cell_count bytes (the rows, in cell order)
        per layer: i32 v_type, u64 v_row_bytes, v_row_bytes * cell_count bytes

A cell's position, not its index, says where its rows go: the row of position p of a tensor is at
``offset + p * stride`` in its region (the share header, docs/protocol.md).  A job is refused (an
``error`` answer, so the request goes plain) when the file is not of that shape to the last byte (a
model whose cells carry extra per-cell data, M-RoPE or PLE, is one such), when the cache is transposed
(``v_trans``), when the layer count, a row size or the rotation (``n_rot_k``, ``n_rot_v``) differs from
the header's, or when the file's tokens are not the job's.  The claim is the number of positions 0..k-1
written without a gap, so a state that holds fewer than the job's tokens is a short claim.
"""

from __future__ import annotations

import array
import contextlib
import http.client
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from .statefile import MAGIC as STATE_MAGIC
from .statefile import VERSION as STATE_VERSION
from .statefile import Reader, StateFileError

# Regions per job: one per slot today; more than this is not a layout.
_MAX_FDS = 64
# The worker's own llama-server answers a local prefill within this, or is broken.
_HTTP_TIMEOUT_S = 600.0
# A llama-server loads the default model in seconds; a big model on a slow disk, in a minute or two.
_START_TIMEOUT_S = 300.0


class Refused(Exception):
    """A job this worker cannot do, said in its answer's ``error``."""


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=_HTTP_TIMEOUT_S)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(_HTTP_TIMEOUT_S)
        sock.connect(self.unix_path)
        self.sock = sock


def call(path: str, method: str, url: str, body: object | None = None) -> tuple[int, Any]:
    conn = _UnixHTTPConnection(path)
    try:
        conn.request(method, url, body=None if body is None else json.dumps(body))
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


class _Reader(Reader):
    """statefile's reader, its truncation a refusal of the share (this worker's one error)."""

    def take(self, n: int) -> bytes:
        try:
            return super().take(n)
        except StateFileError:
            raise Refused(f"the state file ends at byte {len(self.data)}, inside a field at {self.at}") from None


def unpack_prompt(packed: list[int]) -> list[int]:
    """The prompt's tokens from the file's token list: llama-server packs them (its ``server_tokens``
    serialization) as -1, version 1, the count, the tokens, then the media count, which must be 0."""
    if not packed or packed[0] != -1:
        return packed  # a plain token list, as older servers wrote
    if len(packed) < 3 or packed[1] != 1:
        raise Refused("the state file's prompt is packed in an unknown version")
    n = packed[2]
    if not 0 <= n <= len(packed) - 4 or packed[3 + n] != 0:
        raise Refused("the state file's prompt holds media or does not parse")
    return packed[3 : 3 + n]


def read_prompt(r: _Reader) -> list[int]:
    """The magic, the version and the prompt's tokens: the first fields of a slot state file."""
    if r.u32() != STATE_MAGIC or r.u32() != STATE_VERSION:
        raise Refused(f"not a version-{STATE_VERSION} llama.cpp slot state file")
    n_token = r.u32()
    return unpack_prompt(list(struct.unpack(f"<{n_token}i", r.take(4 * n_token))))


class SlotState:
    """One sequence's cells as a slot state file holds them: positions, and per layer the K and V rows."""

    def __init__(self, data: bytes) -> None:
        r = _Reader(data)
        self.tokens = read_prompt(r)
        self.positions: list[int] = []
        self.k_rows: list[tuple[int, memoryview]] = []  # per layer: row bytes, the rows in cell order
        self.v_rows: list[tuple[int, memoryview]] = []
        self.n_rot_k = self.n_rot_v = 0
        view = memoryview(data)
        n_stream = r.u32()
        for _ in range(n_stream):
            cell_count = r.u32()
            if cell_count == 0:
                continue
            if self.positions:
                raise Refused("the state file holds cells in more than one stream")
            for _ in range(cell_count):
                pos, n_seq_id = r.i32(), r.u32()
                if n_seq_id != 1:
                    raise Refused(f"a cell belongs to {n_seq_id} sequences (cells with extra data?)")
                r.take(4)  # the saving server's seq id, ours to ignore as the decoder's restore does
                self.positions.append(pos)
            v_trans, n_layer, self.n_rot_k, self.n_rot_v = r.u32(), r.u32(), r.u32(), r.u32()
            if v_trans:
                raise Refused("the saved V cache is transposed (flash attention off)")
            for rows in (self.k_rows, self.v_rows):
                for _ in range(n_layer):
                    r.i32()  # the type: the header's row sizes are what must agree
                    row_bytes = r.u64()
                    start = r.at
                    r.take(row_bytes * cell_count)
                    rows.append((row_bytes, view[start : r.at]))
        if r.at != len(data):
            raise Refused(f"{len(data) - r.at} bytes after the last field: not the layout this worker parses")

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(first cell, first position, length) of each run of cells whose positions go up by one."""
        i = 0
        while i < len(self.positions):
            j = i + 1
            while j < len(self.positions) and self.positions[j] == self.positions[j - 1] + 1:
                j += 1
            yield i, self.positions[i], j - i
            i = j


def write_rows(state: SlotState, layout: dict[str, Any], regions: list[mmap.mmap], n_tokens: int) -> int:
    """Copy positions 0..n_tokens-1 into the regions; the claim: how many positions from 0 were written."""
    tensors = layout.get("tensors")
    if not isinstance(tensors, list):
        raise Refused("the share header has no tensors")
    if layout.get("v_trans"):
        raise Refused("the decoder's V cache is transposed")
    if (layout.get("n_rot_k", 0), layout.get("n_rot_v", 0)) != (state.n_rot_k, state.n_rot_v):
        raise Refused(
            f"the decoder rotates K/V by {layout.get('n_rot_k')}/{layout.get('n_rot_v')}, "
            f"the saved state by {state.n_rot_k}/{state.n_rot_v}"
        )
    keys = [t for t in tensors if t.get("kind") == "k"]
    values = [t for t in tensors if t.get("kind") == "v"]
    if len(keys) != len(state.k_rows) or len(values) != len(state.v_rows):
        raise Refused(
            f"the decoder lends {len(keys)} K and {len(values)} V tensors, "
            f"the state file holds {len(state.k_rows)} and {len(state.v_rows)} layers"
        )
    written = [False] * n_tokens
    for tensor, (row_bytes, rows) in zip([*keys, *values], [*state.k_rows, *state.v_rows], strict=True):
        stride = int(tensor.get("stride", tensor["row_bytes"]))
        if int(tensor["row_bytes"]) != row_bytes or stride < row_bytes:
            raise Refused(f"{tensor.get('name')}: rows of {tensor['row_bytes']} bytes, the state file's {row_bytes}")
        region = regions[int(tensor["region"])]
        offset = int(tensor["offset"])
        for cell, pos, length in state.runs():
            length = min(length, n_tokens - pos) if pos >= 0 else 0
            if length <= 0:
                continue
            src = rows[cell * row_bytes : (cell + length) * row_bytes]
            at = offset + pos * stride
            if at + length * stride > len(region):
                raise Refused(f"{tensor.get('name')}: position {pos + length - 1} is outside its region")
            if stride == row_bytes:
                region[at : at + len(src)] = src
            else:
                for i in range(length):
                    region[at + i * stride : at + i * stride + row_bytes] = src[i * row_bytes : (i + 1) * row_bytes]
    for pos in state.positions:
        if 0 <= pos < n_tokens:
            written[pos] = True
    claimed = 0
    while claimed < n_tokens and written[claimed]:
        claimed += 1
    return claimed


class Channel:
    """The socket to onebitd: job lines in, with the share jobs' fds (SCM_RIGHTS) kept in arrival order."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.buffer = b""
        self.fds: deque[int] = deque()

    def lines(self) -> Iterator[dict[str, Any]]:
        while True:
            while b"\n" not in self.buffer:
                data, ancdata, _flags, _addr = self.sock.recvmsg(
                    65536, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
                )
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                        self.fds.extend(got)
                if not data:
                    return
                self.buffer += data
            line, self.buffer = self.buffer.split(b"\n", 1)
            if line.strip():
                job = json.loads(line)
                if isinstance(job, dict):
                    yield job

    def take_fds(self, n: int) -> list[int]:
        if len(self.fds) < n:
            raise Refused(f"the job names {n} region fds, {len(self.fds)} came with it")
        return [self.fds.popleft() for _ in range(n)]

    def send(self, answer: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(answer).encode() + b"\n")


class Worker:
    def __init__(self, server_socket: str, save_dir: Path) -> None:
        self.server_socket = server_socket
        self.save_dir = save_dir

    def _prefill_and_save(self, job: dict[str, Any], name: str) -> tuple[float, Path]:
        status, done = call(
            self.server_socket, "POST", "/completion", {"prompt": job["tokens"], "n_predict": 0, "id_slot": 0}
        )
        if status != 200 or not isinstance(done, dict):
            raise Refused(f"prefill answered {status}: {json.dumps(done)[:200]}")
        status, saved = call(self.server_socket, "POST", "/slots/0?action=save", {"filename": name})
        if status != 200 or not isinstance(saved, dict):
            raise Refused(f"save answered {status}: {json.dumps(saved)[:200]}")
        return float(done.get("timings", {}).get("prompt_ms", 0.0)), self.save_dir / name

    def file_job(self, job: dict[str, Any]) -> dict[str, Any]:
        prefill_ms, path = self._prefill_and_save(job, f"file-{os.getpid()}.state")
        try:
            # The decoder restores the file whatever its cells look like (a transposed V included):
            # only the prompt is read here, for the claim.
            with path.open("rb") as file:
                tokens = read_prompt(_Reader(file.read(1 << 20)))
            shutil.move(path, job["state_file"])
        finally:
            path.unlink(missing_ok=True)
        return {"n_tokens": len(tokens), "prefill_ms": prefill_ms}

    def share_job(self, job: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        prefill_ms, path = self._prefill_and_save(job, f"share-{os.getpid()}.state")
        try:
            written = write_saved_state(path, job["tokens"], job["layout"], fds)
        finally:
            path.unlink(missing_ok=True)
        return {"n_tokens": written, "prefill_ms": prefill_ms}


def write_saved_state(path: Path, tokens: list[int], layout: dict[str, Any], fds: list[int]) -> int:
    """Parse the slot state file at ``path`` and copy its rows for ``tokens`` into the lent regions
    (``fds``, in the order of ``layout["regions"]``); the claim.  Raises :class:`Refused`."""
    regions: list[mmap.mmap] = []
    try:
        for fd, region in zip(fds, layout["regions"], strict=True):
            regions.append(mmap.mmap(fd, int(region["size"])))
        state = SlotState(path.read_bytes())
        if state.tokens[: len(tokens)] != tokens:
            raise Refused("the saved state is not of the job's tokens")
        return write_rows(state, layout, regions, len(tokens))
    finally:
        for region in regions:
            region.close()


def _save_dir(parent: str) -> tempfile.TemporaryDirectory[str]:
    # tmpfs when there is one: the state file is written and read once, never kept.
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else parent
    return tempfile.TemporaryDirectory(prefix="onebit-share-", dir=base)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m supervisor.share_worker LLAMA_SERVER [llama-server model args]", file=sys.stderr)
        return 2
    binary, *model_args = args
    channel = Channel(int(os.environ["ONEBIT_PROVIDER_FD"]))
    # The worker's own llama-server is a stock one: its KV stays where llama.cpp puts it.
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_KV_SHARE", "ONEBIT_PROVIDER_FD")}
    with tempfile.TemporaryDirectory(prefix="onebit-sw-") as tmp, _save_dir(tmp) as save:
        server_socket = os.path.join(tmp, "llama.sock")
        server = subprocess.Popen(
            [binary, *model_args, "--host", server_socket, "--slot-save-path", save + "/", "--no-webui"],
            stdout=sys.stderr,
            stderr=sys.stderr,
            env=env,
        )

        def stop(_signum: int, _frame: FrameType | None) -> None:
            # No wait() here: the handler may run inside the main thread's own server.wait().  Kill,
            # clean up, leave; onebitd reaps our process group.
            server.kill()
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(save, ignore_errors=True)
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while True:  # polling our own child's health: a start-up gate, not a wait for a condition we cause
                with contextlib.suppress(OSError, ValueError):
                    if call(server_socket, "GET", "/health")[0] == 200:
                        break
                if server.poll() is not None or time.monotonic() > deadline:
                    print("share_worker: llama-server did not become healthy", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            worker = Worker(server_socket, Path(save))
            channel.send({"ready": True})
            for job in channel.lines():
                if "cancel" in job:
                    continue  # one job at a time: a cancelled one has already been answered
                answer: dict[str, Any] = {"id": job.get("id")}
                fds: list[int] = []
                try:
                    if job.get("route") == "share":
                        fds = channel.take_fds(len(job.get("fds", [])))
                        answer.update(worker.share_job(job, fds))
                    else:
                        answer.update(worker.file_job(job))
                except (Refused, OSError, KeyError, TypeError, ValueError) as exc:
                    answer["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Refused) else str(exc)
                finally:
                    for fd in fds:
                        os.close(fd)
                channel.send(answer)
            return 0
        finally:
            server.terminate()
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


if __name__ == "__main__":
    sys.exit(main())
