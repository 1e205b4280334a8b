"""A slot state file's rows written into the region the decoder lent (the share route's provider side):
what supervisor/llama/share_worker.py and the llama-server provider (supervisor/providers/llama.py) copy.

The slot state file read here is llama.cpp's ``llama_state_seq_save_file`` (``LLAMA_STATE_SEQ_VERSION``
4), little-endian:

    u32 magic 0x67677371 ('ggsq'), u32 version 4, u32 n_token, i32 token[n_token]
        (llama-server packs its prompt there: -1, 1 (its version), the count, the tokens, the media
        count, which must be 0; a list not starting with -1 is taken as the tokens themselves)
    u32 n_stream; per stream: u32 cell_count, and when cell_count > 0:
        per cell:  i32 pos, u32 n_seq_id (1), [12 bytes of M-RoPE position and token], i32 seq_id
        u32 v_trans, u32 n_layer, u32 n_rot_k, u32 n_rot_v
        per layer: i32 k_type, u64 k_row_bytes, k_row_bytes * cell_count bytes (the rows, in cell order)
        per layer: i32 v_type, u64 v_row_bytes, v_row_bytes * cell_count bytes
    and for a hybrid model (a KV cache beside a recurrent memory), its recurrent cell:
        u32 cell_count (1), i32 pos, u32 n_seq_id (0), u32 s_trans (0), u32 n_layer
        per recurrent layer: i32 r_type, u64 row_bytes, the R row; [u64 row_bytes, the P row]
        per recurrent layer: i32 s_type, u64 row_bytes, the S row

A cell's position, not its index, says where its K and V rows go: the row of position p of a tensor is
at ``offset + p * stride`` in its region (the share header, docs/protocol.md).  A recurrent state row
(kinds ``r``, ``p``, ``s``) goes whole to its ``offset``; the header lists them in the file's order, and
the state must be the one after the job's last token.  A job is refused (an ``error`` answer, so the
request goes plain) when the file is not of that shape to the last byte (a model whose cells carry
per-cell data other than M-RoPE's is one such), when the cache is transposed (``v_trans``), when the
layer count, a row's type or size or the rotation (``n_rot_k``, ``n_rot_v``) differs from the header's,
when the header names a kind of row this module does not know, when the recurrent state is not at the
job's last position, or when the file's tokens are not the job's.  Row sizes alone do not tell one
type from another (an f32 row of 64 values is as long as an f16 row of 128), and the decoder's adopt
stamps the staged rows with its own types (patches/llama-server-share.patch), so the types are
compared here: each tensor's ``type`` in the header (a ggml type name) against the file's
row type, and the header's ``n_layer`` (its K tensors) against the file's KV layer count.  The header
carries no count of the model's layers, which the recurrent part's ``n_layer`` is: there every
tensor's ``layer`` must be below it.  The claim (:class:`Written`) is the number of
positions 0..k-1 written without a gap, so a state that holds fewer than the job's tokens is a short
claim, and the number of recurrent state rows written, which onebitd needs to adopt a hybrid's share.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .statefile import CELL_EXT_BYTES, Reader, StateFileError
from .statefile import MAGIC as STATE_MAGIC
from .statefile import VERSION as STATE_VERSION


class JobRefused(Exception):
    """A job this worker cannot do, said in its answer's ``error``."""


class StateReader(Reader):
    """statefile's reader, its truncation a refusal of the share (this worker's one error)."""

    def take(self, n: int) -> bytes:
        try:
            return super().take(n)
        except StateFileError:
            raise JobRefused(f"the state file ends at byte {len(self.data)}, inside a field at {self.at}") from None


def unpack_prompt(packed: list[int]) -> list[int]:
    """The prompt's tokens from the file's token list: llama-server packs them (its ``server_tokens``
    serialization) as -1, version 1, the count, the tokens, then the media count, which must be 0."""
    if not packed or packed[0] != -1:
        return packed  # a plain token list, as older servers wrote
    if len(packed) < 3 or packed[1] != 1:
        raise JobRefused("the state file's prompt is packed in an unknown version")
    n = packed[2]
    if not 0 <= n <= len(packed) - 4 or packed[3 + n] != 0:
        raise JobRefused("the state file's prompt holds media or does not parse")
    return packed[3 : 3 + n]


def read_prompt(r: StateReader) -> list[int]:
    """The magic, the version and the prompt's tokens: the first fields of a slot state file."""
    if r.u32() != STATE_MAGIC or r.u32() != STATE_VERSION:
        raise JobRefused(f"not a version-{STATE_VERSION} llama.cpp slot state file")
    n_token = r.u32()
    return unpack_prompt(list(struct.unpack(f"<{n_token}i", r.take(4 * n_token))))


# ggml_type numbers (ggml/include/ggml.h) and ggml_type_name's names of the types a cache row can have:
# llama-server's -ctk/-ctv choices (common/arg.cpp's kv_cache_types); a recurrent state's are f32.
TYPE_NAMES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl", 30: "bf16"}


def type_name(ggml_type: int) -> str:
    """A row type's ggml name; :class:`JobRefused` for a number this worker does not know."""
    name = TYPE_NAMES.get(ggml_type)
    if name is None:
        raise JobRefused(f"the state file holds rows of ggml type {ggml_type}, which this worker does not know")
    return name


# The kinds of a share header's rows: K and V per position; a hybrid's recurrent state (R, its PLE
# convolution P, S), one row each, in the order its state file holds them.
KV_KINDS = ("k", "v")
STATE_KINDS = ("r", "p", "s")


def state_kinds(layout: dict[str, Any]) -> list[str]:
    """The kinds of the recurrent state rows the decoder lends, in the header's order (none: no
    recurrent part).  Raises :class:`JobRefused` for a kind that is neither K/V nor a state's."""
    kinds = []
    for tensor in layout.get("tensors") or ():
        kind = tensor.get("kind")
        if kind not in KV_KINDS + STATE_KINDS:
            raise JobRefused(f"{tensor.get('name')}: rows of kind {kind!r}, which this worker cannot write")
        if kind in STATE_KINDS:
            kinds.append(kind)
    return kinds


class StateRows:
    """One sequence's cells as a slot state file holds them: positions, per layer the K and V rows, and
    a hybrid model's recurrent rows (``states``: their kinds, in the share header's order)."""

    def __init__(self, data: bytes, states: Sequence[str] = ()) -> None:
        try:
            self._read(data, states, cell_ext=False)
        except JobRefused as plain:
            # An M-RoPE model's cells carry their 2D position and token; the file does not say so.
            try:
                self._read(data, states, cell_ext=True)
            except JobRefused:
                raise plain from None

    def _read(self, data: bytes, states: Sequence[str], *, cell_ext: bool) -> None:
        r = StateReader(data)
        self.tokens = read_prompt(r)
        self.positions: list[int] = []
        self.k_rows: list[tuple[int, memoryview]] = []  # per layer: row bytes, the rows in cell order
        self.v_rows: list[tuple[int, memoryview]] = []
        self.k_types: list[int] = []  # per layer: the ggml type of its K rows
        self.v_types: list[int] = []
        self.n_layer = 0  # the KV cache's layers (0: no cells read)
        self.state_pos = -1  # the position the recurrent state is after (-1: none read)
        self.state_rows: list[tuple[int, memoryview]] = []  # per entry of ``states``: row bytes, the row
        self.state_types: list[int | None] = []  # per entry of ``states``: its type (None: a P row has none)
        self.state_n_layer = 0  # the model's layers, as the recurrent part counts them
        self.n_rot_k = self.n_rot_v = 0
        view = memoryview(data)
        n_stream = r.u32()
        for _ in range(n_stream):
            cell_count = r.u32()
            if cell_count == 0:
                continue
            if self.positions:
                raise JobRefused("the state file holds cells in more than one stream")
            for _ in range(cell_count):
                pos, n_seq_id = r.i32(), r.u32()
                if n_seq_id != 1:
                    raise JobRefused(f"a cell belongs to {n_seq_id} sequences (cells with extra data?)")
                r.take((CELL_EXT_BYTES if cell_ext else 0) + 4)  # the saving server's seq id, ours to ignore
                self.positions.append(pos)
            v_trans, self.n_layer, self.n_rot_k, self.n_rot_v = r.u32(), r.u32(), r.u32(), r.u32()
            if v_trans:
                raise JobRefused("the saved V cache is transposed (flash attention off)")
            for rows, types in ((self.k_rows, self.k_types), (self.v_rows, self.v_types)):
                for _ in range(self.n_layer):
                    types.append(r.i32())
                    row_bytes = r.u64()
                    start = r.at
                    r.take(row_bytes * cell_count)
                    rows.append((row_bytes, view[start : r.at]))
        if states:
            self._read_state(r, view, states)
        if r.at != len(data):
            raise JobRefused(f"{len(data) - r.at} bytes after the last field: not the layout this worker parses")

    def _read_state(self, r: StateReader, view: memoryview, states: Sequence[str]) -> None:
        """The recurrent memory's one cell: the row of each of ``states``, the kinds the decoder lends."""
        cell_count = r.u32()
        if cell_count != 1:
            raise JobRefused(f"the saved recurrent memory holds {cell_count} cells, not the sequence's one")
        self.state_pos = r.i32()
        r.take(4 * r.u32())
        if r.u32() != 0:
            raise JobRefused("the saved recurrent state is transposed")
        self.state_n_layer = r.u32()  # every layer's count: which of them are recurrent, the header's rows say
        for kind in states:
            # The P row travels with its layer's R row, without a type of its own.
            self.state_types.append(None if kind == "p" else r.i32())
            row_bytes = r.u64()
            start = r.at
            r.take(row_bytes)
            self.state_rows.append((row_bytes, view[start : r.at]))

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(first cell, first position, length) of each run of cells whose positions go up by one."""
        i = 0
        while i < len(self.positions):
            j = i + 1
            while j < len(self.positions) and self.positions[j] == self.positions[j - 1] + 1:
                j += 1
            yield i, self.positions[i], j - i
            i = j


class Written(NamedTuple):
    """What :func:`write_rows` wrote: the claim's ``n_tokens`` and ``state_rows``."""

    n_tokens: int  # positions from 0 written without a gap
    state_rows: int  # recurrent state rows written (0: a model without a recurrent part)

    def claim(self) -> dict[str, int]:
        """The claim's fields (docs/protocol.md, the share route's step 4)."""
        return {"n_tokens": self.n_tokens, "state_rows": self.state_rows}


def check_types(state: StateRows, layout: dict[str, Any], tensors: list[dict[str, Any]]) -> None:
    """Refuse a state file whose layer count or row types are not the header's (where it says them)."""
    if state.positions and "n_layer" in layout and int(layout["n_layer"]) != state.n_layer:
        raise JobRefused(f"the decoder's KV cache has {layout['n_layer']} layers, the state file's {state.n_layer}")
    if state.state_rows:
        for tensor in tensors:
            if "layer" in tensor and int(tensor["layer"]) >= state.state_n_layer:
                raise JobRefused(
                    f"{tensor.get('name')}: layer {tensor['layer']} of a model the state file says has"
                    f" {state.state_n_layer} layers"
                )
    keys = [t for t in tensors if t.get("kind") == "k"]
    values = [t for t in tensors if t.get("kind") == "v"]
    states = [t for t in tensors if t.get("kind") in STATE_KINDS]
    typed = [*zip(keys, state.k_types, strict=False), *zip(values, state.v_types, strict=False)]
    typed += [(t, ggml_type) for t, ggml_type in zip(states, state.state_types, strict=False) if ggml_type is not None]
    for tensor, ggml_type in typed:
        if "type" in tensor and tensor["type"] != type_name(ggml_type):
            raise JobRefused(
                f"{tensor.get('name')}: rows of type {tensor['type']}, the state file's {type_name(ggml_type)}"
            )


def write_rows(state: StateRows, layout: dict[str, Any], regions: list[mmap.mmap], n_tokens: int) -> Written:
    """Copy positions 0..n_tokens-1 and the recurrent state rows into the regions; what was written."""
    tensors = layout.get("tensors")
    if not isinstance(tensors, list):
        raise JobRefused("the share header has no tensors")
    check_types(state, layout, tensors)
    if layout.get("v_trans"):
        raise JobRefused("the decoder's V cache is transposed")
    if (layout.get("n_rot_k", 0), layout.get("n_rot_v", 0)) != (state.n_rot_k, state.n_rot_v):
        raise JobRefused(
            f"the decoder rotates K/V by {layout.get('n_rot_k')}/{layout.get('n_rot_v')}, "
            f"the saved state by {state.n_rot_k}/{state.n_rot_v}"
        )
    states = [t for t in tensors if t.get("kind") in STATE_KINDS]
    if len(states) != len(state.state_rows):
        raise JobRefused(
            f"the decoder lends {len(states)} recurrent rows, the state file holds {len(state.state_rows)}"
        )
    if states and state.state_pos != n_tokens - 1:
        raise JobRefused(
            f"the saved recurrent state is after position {state.state_pos}, not the job's last ({n_tokens - 1})"
        )
    for tensor, (row_bytes, row) in zip(states, state.state_rows, strict=True):
        region = regions[int(tensor["region"])]
        at = int(tensor["offset"])
        if int(tensor["row_bytes"]) != row_bytes:
            raise JobRefused(
                f"{tensor.get('name')}: a row of {tensor['row_bytes']} bytes, the state file's {row_bytes}"
            )
        if at + row_bytes > len(region):
            raise JobRefused(f"{tensor.get('name')}: its row is outside its region")
        region[at : at + row_bytes] = row
    keys = [t for t in tensors if t.get("kind") == "k"]
    values = [t for t in tensors if t.get("kind") == "v"]
    if len(keys) != len(state.k_rows) or len(values) != len(state.v_rows):
        raise JobRefused(
            f"the decoder lends {len(keys)} K and {len(values)} V tensors, "
            f"the state file holds {len(state.k_rows)} and {len(state.v_rows)} layers"
        )
    written = [False] * n_tokens
    for tensor, (row_bytes, rows) in zip([*keys, *values], [*state.k_rows, *state.v_rows], strict=True):
        stride = int(tensor.get("stride", tensor["row_bytes"]))
        if int(tensor["row_bytes"]) != row_bytes or stride < row_bytes:
            name = tensor.get("name")
            raise JobRefused(f"{name}: rows of {tensor['row_bytes']} bytes, the state file's {row_bytes}")
        region = regions[int(tensor["region"])]
        offset = int(tensor["offset"])
        for cell, pos, length in state.runs():
            length = min(length, n_tokens - pos) if pos >= 0 else 0
            if length <= 0:
                continue
            src = rows[cell * row_bytes : (cell + length) * row_bytes]
            at = offset + pos * stride
            if at + length * stride > len(region):
                raise JobRefused(f"{tensor.get('name')}: position {pos + length - 1} is outside its region")
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
    return Written(claimed, len(states))


def write_saved_state(path: Path, tokens: list[int], layout: dict[str, Any], fds: list[int]) -> Written:
    """Parse the slot state file at ``path`` and copy its rows for ``tokens`` into the lent regions
    (``fds``, in the order of ``layout["regions"]``); the claim.  Raises :class:`JobRefused`."""
    regions: list[mmap.mmap] = []
    try:
        for fd, region in zip(fds, layout["regions"], strict=True):
            regions.append(mmap.mmap(fd, int(region["size"])))
        state = StateRows(path.read_bytes(), state_kinds(layout))
        if state.tokens[: len(tokens)] != tokens:
            raise JobRefused("the saved state is not of the job's tokens")
        return write_rows(state, layout, regions, len(tokens))
    finally:
        for region in regions:
            region.close()
