"""A llama.cpp slot state file, read: its tokens and each memory part's rows, as floats.

``POST /slots/N?action=save`` writes ``llama_state_seq_save_file``'s format (llama.cpp's
src/llama-context.cpp, src/llama-kv-cache.cpp and src/llama-memory-recurrent.cpp,
``LLAMA_STATE_SEQ_VERSION`` 4), all little-endian::

    u32 magic 'ggsq'   u32 version   u32 n_tokens   i32 tokens[n_tokens]
    then each part of the model's memory, in its order:

    a KV cache:
    u32 n_stream, then per stream: u32 cell_count, and when it is not 0:
        per cell:  i32 pos, u32 n_seq, [the cell's 12-byte extension], i32 seq_id[n_seq]
        u32 v_trans   u32 n_layer   u32 n_rot_k   u32 n_rot_v
        per layer: i32 k_type, u64 row_bytes, cell_count rows
        per layer: i32 v_type, u64 row_bytes, cell_count rows                     (v_trans 0)
               or: i32 v_type, u32 element_bytes, u32 n_embd_v, n_embd_v columns  (v_trans 1)

    a recurrent memory (always last):
    u32 cell_count, per cell: i32 pos, u32 n_seq (0), then u32 s_trans (0), u32 n_layer (all layers)
        per recurrent layer: i32 r_type, u64 row_bytes, cell_count rows   (R: the convolution state)
        per recurrent layer: i32 s_type, u64 row_bytes, cell_count rows   (S: the SSM or delta-net state;
                                                                           0 bytes where there is none)

What the parts are the file does not say; they are the model's memory (src/llama-model.cpp): one KV
cache (a dense model); two, the full-attention layers' then the sliding window's (an SWA model,
``kv base`` and ``kv swa``); a KV cache and a recurrent memory (a hybrid: Qwen3.5's gated delta-net,
Granite 4's mamba2, LFM2's convolutions); or two KV caches and a recurrent memory (LFM2 with its
window).  A file is read as each of these in that order until one parses to its end.  The extension
(2D position and token) is there only for M-RoPE and PLE models, which the file does not say either:
a file that does not parse without it is read again with it.  The cache and state types may be f32,
f16, bf16 or q8_0.

statediff.py compares two files read here (``scripts/slotdiff``).  The prefix store checks a file's
magic only (:func:`has_magic`); share_worker.py reads a file's fields with :class:`Reader`.
"""

from __future__ import annotations

import array
import struct
from pathlib import Path

import attrs

MAGIC = 0x67677371  # LLAMA_STATE_SEQ_MAGIC, 'ggsq'
MAGIC_BYTES = MAGIC.to_bytes(4, "little")  # what a state file's first four bytes are
VERSION = 4  # LLAMA_STATE_SEQ_VERSION
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: i32 x, i32 y, i32 tok

# ggml_type numbers (ggml/include/ggml.h) of the cache types this module decodes.
GGML_F32, GGML_F16, GGML_Q8_0, GGML_BF16 = 0, 1, 8, 30
TYPE_NAMES = {GGML_F32: "f32", GGML_F16: "f16", GGML_Q8_0: "q8_0", GGML_BF16: "bf16"}
Q8_0_BLOCK = 32  # values per q8_0 block: an f16 scale and 32 int8


class StateFileError(ValueError):
    """Not a slot state file this module can read (the message says why)."""


@attrs.frozen
class Layer:
    k_type: int
    v_type: int
    k: array.array[float]  # cell-major: cell c's row is k[c * k_width:(c + 1) * k_width]
    v: array.array[float]  # cell-major too (a transposed V is turned around); both empty: read without KV values
    k_width: int
    v_width: int


@attrs.frozen
class KvCache:
    """One KV cache of the memory: its cells' positions, in file order, and each layer's K and V rows."""

    name: str  # "kv" (the only one), "kv base" or "kv swa"
    n_stream: int
    positions: tuple[int, ...]
    layers: tuple[Layer, ...]


@attrs.frozen
class Rows:
    """One recurrent layer's R or S rows, a cell's row after another."""

    type: int
    values: array.array[float]
    width: int


@attrs.frozen
class Recurrent:
    """A recurrent memory: its cells (a sequence's state is one cell, at its last token's position)
    and each recurrent layer's R (convolution) and S (SSM or delta-net) rows."""

    positions: tuple[int, ...]
    r: tuple[Rows, ...]
    s: tuple[Rows, ...]


@attrs.frozen
class SlotState:
    tokens: tuple[int, ...]  # as the file holds them (llama-server packs them behind a -1 and a version)
    caches: tuple[KvCache, ...]
    recurrent: Recurrent | None = None

    @property
    def positions(self) -> tuple[int, ...]:
        """The first KV cache's cell positions (none without one)."""
        return self.caches[0].positions if self.caches else ()

    @property
    def n_stream(self) -> int:
        return self.caches[0].n_stream if self.caches else 0

    @property
    def layers(self) -> tuple[Layer, ...]:
        """The first KV cache's layers."""
        return self.caches[0].layers if self.caches else ()

    @property
    def n_cells(self) -> int:
        return len(self.positions)


class Reader:
    """Little-endian fields read in order from a state file's bytes; StateFileError past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise StateFileError(f"truncated: wanted {n} bytes at offset {self.at} of {len(self.data)}")
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])


def decode(ggml_type: int, raw: bytes) -> array.array[float]:
    """``raw`` values of ``ggml_type`` as f32 (the types in :data:`TYPE_NAMES`)."""
    out = array.array("f")
    unit = {GGML_F32: 4, GGML_F16: 2, GGML_BF16: 2, GGML_Q8_0: 2 + Q8_0_BLOCK}.get(ggml_type)
    if unit is not None and len(raw) % unit:
        raise StateFileError(f"{len(raw)} bytes of type {ggml_type}: not a whole number of values")
    if ggml_type == GGML_F32:
        out.frombytes(raw)
    elif ggml_type == GGML_F16:
        out.fromlist(list(struct.unpack(f"<{len(raw) // 2}e", raw)))
    elif ggml_type == GGML_BF16:
        # bf16 is the high half of an f32: put each value's two bytes above two zero bytes.
        wide = bytearray(len(raw) * 2)
        wide[2::4] = raw[0::2]
        wide[3::4] = raw[1::2]
        out.frombytes(bytes(wide))
    elif ggml_type == GGML_Q8_0:
        block = 2 + Q8_0_BLOCK
        for start in range(0, len(raw), block):
            (scale,) = struct.unpack_from("<e", raw, start)
            out.fromlist([scale * q for q in struct.unpack_from(f"<{Q8_0_BLOCK}b", raw, start + 2)])
    else:
        raise StateFileError(f"cache type {ggml_type} is not one this reader decodes ({sorted(TYPE_NAMES.values())})")
    if out.itemsize != 4:  # pragma: no cover - array('f') is a C float everywhere CPython runs
        raise StateFileError("this platform's C float is not 4 bytes")
    return out


def _width(ggml_type: int, row_bytes: int) -> int:
    if ggml_type == GGML_F32:
        return row_bytes // 4
    if ggml_type in (GGML_F16, GGML_BF16):
        return row_bytes // 2
    if ggml_type == GGML_Q8_0:
        return row_bytes // (2 + Q8_0_BLOCK) * Q8_0_BLOCK
    raise StateFileError(f"cache type {ggml_type} is not one this reader decodes ({sorted(TYPE_NAMES.values())})")


def _kv_cache(r: Reader, name: str, cell_ext: bool, values: bool) -> KvCache:
    n_stream = r.u32()
    if not 1 <= n_stream <= 4096:
        raise StateFileError(f"implausible stream count {n_stream}: not a KV cache")
    positions: list[int] = []
    layers: list[Layer] | None = None
    for _ in range(n_stream):
        cell_count = r.u32()
        if cell_count == 0:
            continue
        if layers is not None:
            raise StateFileError("cells in more than one stream: one sequence's file has them in one")
        for _cell in range(cell_count):
            positions.append(r.i32())
            n_seq = r.u32()
            if cell_ext:
                r.take(CELL_EXT_BYTES)
            r.take(4 * n_seq)
        v_trans, n_layer, _n_rot_k, _n_rot_v = r.u32(), r.u32(), r.u32(), r.u32()
        if v_trans not in (0, 1) or not 0 <= n_layer <= 4096:  # 0: an SWA model whose every layer is SWA
            raise StateFileError(f"implausible layer header (v_trans {v_trans}, {n_layer} layers)")
        keys: list[tuple[int, int, array.array[float]]] = []
        for _layer in range(n_layer):
            k_type, row_bytes = r.i32(), r.u64()
            raw = r.take(cell_count * row_bytes)
            keys.append((k_type, _width(k_type, row_bytes), decode(k_type, raw) if values else array.array("f")))
        layers = []
        for k_type, k_width, k in keys:
            v_type = r.i32()
            if v_trans:
                element_bytes, n_embd_v = r.u32(), r.u32()
                raw = r.take(n_embd_v * cell_count * element_bytes)
                v = array.array("f", bytes(4 * n_embd_v * cell_count) if values else b"")
                if values:
                    columns = decode(v_type, raw)
                    for j in range(n_embd_v):  # the file holds dimension j of every cell, then j + 1
                        v[j::n_embd_v] = columns[j * cell_count : (j + 1) * cell_count]
                v_width = n_embd_v
            else:
                row_bytes = r.u64()
                v_width = _width(v_type, row_bytes)
                raw = r.take(cell_count * row_bytes)
                v = decode(v_type, raw) if values else array.array("f")
            layers.append(Layer(k_type, v_type, k, v, k_width, v_width))
    return KvCache(name, n_stream, tuple(positions), tuple(layers or ()))


def _recurrent(r: Reader) -> Recurrent:
    """A recurrent memory, read to the end of the file (it is the memory's last part)."""
    cell_count = r.u32()
    if cell_count > 4096:
        raise StateFileError(f"implausible recurrent cell count {cell_count}")
    positions = []
    for _cell in range(cell_count):
        positions.append(r.i32())
        r.take(4 * r.u32())
    s_trans, n_layer = r.u32(), r.u32()
    if s_trans != 0 or not 1 <= n_layer <= 4096:
        raise StateFileError(f"implausible recurrent header (s_trans {s_trans}, {n_layer} layers)")
    # The file does not say how many layers are recurrent: R's and S's entries run to its end, as
    # many of one as of the other.
    entries: list[Rows] = []
    while r.at < len(r.data):
        ggml_type, row_bytes = r.i32(), r.u64()
        values = decode(ggml_type, r.take(cell_count * row_bytes))
        entries.append(Rows(ggml_type, values, _width(ggml_type, row_bytes)))
    half = len(entries) // 2
    if len(entries) % 2 or len(entries) > 2 * n_layer:
        raise StateFileError(f"{len(entries)} recurrent entries for {n_layer} layers: not R and S per layer")
    return Recurrent(tuple(positions), tuple(entries[:half]), tuple(entries[half:]))


# The memories a model can have (src/llama-model.cpp), as the parts its file holds, the likeliest first.
LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("kv",),
    ("kv base", "kv swa"),
    ("kv", "recurrent"),
    ("kv base", "kv swa", "recurrent"),
    ("recurrent",),
)


def _parse(data: bytes, layout: tuple[str, ...], cell_ext: bool, values: bool) -> SlotState:
    r = Reader(data)
    if r.u32() != MAGIC:
        raise StateFileError("not a llama.cpp slot state file (no 'ggsq' magic)")
    version = r.u32()
    if version != VERSION:
        raise StateFileError(f"state file version {version}, this reader knows {VERSION}")
    n_tokens = r.u32()
    tokens = struct.unpack(f"<{n_tokens}i", r.take(4 * n_tokens))
    caches = tuple(_kv_cache(r, name, cell_ext, values) for name in layout if name != "recurrent")
    recurrent = _recurrent(r) if layout[-1] == "recurrent" else None
    if r.at != len(data):
        raise StateFileError(f"{len(data) - r.at} bytes left over after the {' and '.join(layout)}")
    return SlotState(tuple(tokens), caches, recurrent)


def parse(data: bytes, *, kv_values: bool = True) -> SlotState:
    """A slot state file's contents, read (see the module docstring); raises :class:`StateFileError`
    with why the likeliest reading, a plain KV cache's, failed.  ``kv_values`` false: the KV caches'
    cells and row widths are read, their rows left empty (decoding them is most of the cost)."""
    failed: list[StateFileError] = []
    for cell_ext in (False, True):
        for layout in LAYOUTS:
            try:
                return _parse(data, layout, cell_ext, kv_values)
            except StateFileError as exc:
                failed.append(exc)
    raise failed[0]


def read(path: Path, *, kv_values: bool = True) -> SlotState:
    return parse(path.read_bytes(), kv_values=kv_values)


def has_magic(path: Path) -> bool:
    """Whether the file starts as a slot state file does, read no further (the prefix store's check
    of a file it takes or finds).  Raises OSError."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC_BYTES)) == MAGIC_BYTES
