"""A llama.cpp slot state file, read: its tokens and each layer's K and V rows, as floats.

``POST /slots/N?action=save`` writes ``llama_state_seq_save_file``'s format (llama.cpp's
src/llama-context.cpp and src/llama-kv-cache.cpp, ``LLAMA_STATE_SEQ_VERSION`` 4), all little-endian::

    u32 magic 'ggsq'   u32 version   u32 n_tokens   i32 tokens[n_tokens]
    u32 n_stream, then per stream: u32 cell_count, and when it is not 0:
        per cell:  i32 pos, u32 n_seq, [the cell's 12-byte extension], i32 seq_id[n_seq]
        u32 v_trans   u32 n_layer   u32 n_rot_k   u32 n_rot_v
        per layer: i32 k_type, u64 row_bytes, cell_count rows
        per layer: i32 v_type, u64 row_bytes, cell_count rows                     (v_trans 0)
               or: i32 v_type, u32 element_bytes, u32 n_embd_v, n_embd_v columns  (v_trans 1)

The extension (2D position and token) is there only for M-RoPE and PLE models, which the file does
not say: a file that does not parse to its end without it is read again with it.  Only a plain KV
cache is understood (not the SWA pair, recurrent or hybrid memories); the K and V types may be f32,
f16, bf16 or q8_0.  :func:`layer_errors` compares two files layer by layer; ``scripts/slotdiff``
prints it.  The prefix store checks a file's magic only (:func:`has_magic`); share_worker.py reads
a file's fields with :class:`Reader`.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Sequence
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
    v: array.array[float]  # cell-major too (a transposed V is turned around)
    k_width: int
    v_width: int


@attrs.frozen
class SlotState:
    tokens: tuple[int, ...]
    positions: tuple[int, ...]  # of each cell, in file order
    n_stream: int
    layers: tuple[Layer, ...]

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


def _parse(data: bytes, cell_ext: bool) -> SlotState:
    r = Reader(data)
    if r.u32() != MAGIC:
        raise StateFileError("not a llama.cpp slot state file (no 'ggsq' magic)")
    version = r.u32()
    if version != VERSION:
        raise StateFileError(f"state file version {version}, this reader knows {VERSION}")
    n_tokens = r.u32()
    tokens = struct.unpack(f"<{n_tokens}i", r.take(4 * n_tokens))
    n_stream = r.u32()
    if not 1 <= n_stream <= 4096:
        raise StateFileError(f"implausible stream count {n_stream}: not a plain KV cache's file")
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
        if v_trans not in (0, 1) or not 1 <= n_layer <= 4096:
            raise StateFileError(f"implausible layer header (v_trans {v_trans}, {n_layer} layers)")
        keys: list[tuple[int, int, array.array[float]]] = []
        for _layer in range(n_layer):
            k_type, row_bytes = r.i32(), r.u64()
            keys.append((k_type, _width(k_type, row_bytes), decode(k_type, r.take(cell_count * row_bytes))))
        layers = []
        for k_type, k_width, k in keys:
            v_type = r.i32()
            if v_trans:
                element_bytes, n_embd_v = r.u32(), r.u32()
                columns = decode(v_type, r.take(n_embd_v * cell_count * element_bytes))
                v = array.array("f", bytes(4 * n_embd_v * cell_count))
                for j in range(n_embd_v):  # the file holds dimension j of every cell, then j + 1
                    v[j::n_embd_v] = columns[j * cell_count : (j + 1) * cell_count]
                v_width = n_embd_v
            else:
                row_bytes = r.u64()
                v_width = _width(v_type, row_bytes)
                v = decode(v_type, r.take(cell_count * row_bytes))
            layers.append(Layer(k_type, v_type, k, v, k_width, v_width))
    if r.at != len(data):
        raise StateFileError(f"{len(data) - r.at} bytes left over after the KV cache")
    return SlotState(tuple(tokens), tuple(positions), n_stream, tuple(layers or ()))


def parse(data: bytes) -> SlotState:
    """A slot state file's contents, read (see the module docstring); raises :class:`StateFileError`."""
    try:
        return _parse(data, cell_ext=False)
    except StateFileError as plain:
        try:
            return _parse(data, cell_ext=True)
        except StateFileError:
            raise plain from None


def read(path: Path) -> SlotState:
    return parse(path.read_bytes())


def has_magic(path: Path) -> bool:
    """Whether the file starts as a slot state file does, read no further (the prefix store's check
    of a file it takes or finds).  Raises OSError."""
    with open(path, "rb") as f:
        return f.read(len(MAGIC_BYTES)) == MAGIC_BYTES


@attrs.frozen
class LayerError:
    layer: int
    k: float  # ||K_a - K_b|| / ||K_b|| over the compared cells
    v: float


def relative_error(a: Sequence[float], b: Sequence[float]) -> float:
    """``||a - b|| / ||b||`` (0 when both are all zeros, inf when only ``b`` is)."""
    diff = math.fsum((x - y) * (x - y) for x, y in zip(a, b, strict=True))
    norm = math.fsum(y * y for y in b)
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / norm)


def layer_errors(a: SlotState, b: SlotState) -> list[LayerError]:
    """Each layer's relative K and V error of ``a`` against ``b`` (the reference), over the cells at
    the positions both hold; raises :class:`StateFileError` when they cannot be compared."""
    if len(a.layers) != len(b.layers):
        raise StateFileError(f"{len(a.layers)} layers against {len(b.layers)}: not the same model")
    cell_of_b = {pos: i for i, pos in enumerate(b.positions)}
    pairs = [(i, cell_of_b[pos]) for i, pos in enumerate(a.positions) if pos in cell_of_b]
    if not pairs:
        raise StateFileError("no position in common")
    errors = []
    for n, (la, lb) in enumerate(zip(a.layers, b.layers, strict=True)):
        if (la.k_width, la.v_width) != (lb.k_width, lb.v_width):
            raise StateFileError(f"layer {n}: rows of {la.k_width}/{la.v_width} against {lb.k_width}/{lb.v_width}")
        errors.append(
            LayerError(n, _rows_error(la.k, lb.k, la.k_width, pairs), _rows_error(la.v, lb.v, la.v_width, pairs))
        )
    return errors


def _rows_error(a: array.array[float], b: array.array[float], width: int, pairs: list[tuple[int, int]]) -> float:
    if all(i == j for i, j in pairs) and len(pairs) * width == len(a) == len(b):
        return relative_error(a, b)
    picked_a = array.array("f")
    picked_b = array.array("f")
    for i, j in pairs:
        picked_a.extend(a[i * width : (i + 1) * width])
        picked_b.extend(b[j * width : (j + 1) * width])
    return relative_error(picked_a, picked_b)


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/slotdiff A.state B.state``: each layer's relative K and V error of A against B."""
    import argparse

    parser = argparse.ArgumentParser(prog="slotdiff", description=main.__doc__)
    parser.add_argument("a", type=Path, help="the slot state file to measure")
    parser.add_argument("b", type=Path, help="the reference slot state file")
    args = parser.parse_args(argv)
    try:
        a, b = read(args.a), read(args.b)
        errors = layer_errors(a, b)
    except (OSError, StateFileError) as exc:
        print(f"slotdiff: {exc}")
        return 2
    common = len(set(a.positions) & set(b.positions))
    print(
        f"{a.n_cells} cells against {b.n_cells}, {common} positions compared; "
        f"tokens {'equal' if a.tokens == b.tokens else 'differ'}"
    )
    print("layer  K rel err  V rel err")
    for e in errors:
        print(f"{e.layer:5d}  {e.k:9.5f}  {e.v:9.5f}")
    print(f"  max  {max(e.k for e in errors):9.5f}  {max(e.v for e in errors):9.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
