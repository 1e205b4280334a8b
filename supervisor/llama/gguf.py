"""A GGUF file's header: the few metadata numbers that size a model's KV cache.

Bring-your-own-bytes, as h11 reads HTTP: :func:`read_shape` reads the header's key/value section
from a binary file object and returns what :func:`kv_bytes_per_token` needs; nothing else of the
file (its tensors) is read.  Layout: ggml's docs/gguf.md (magic, version, tensor and key counts,
then typed key/value pairs, little-endian).
"""

from __future__ import annotations

import struct
from typing import IO, Any

import attrs

MAGIC = b"GGUF"
# Value types (gguf.md's gguf_metadata_value_type): fixed-size ones by struct format.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Bytes per cached value by llama-server's -ctk/-ctv name (ggml's block sizes: q8_0 keeps 32 values
# in 34 bytes, q4_0 in 18, ...).
CACHE_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}


class NotGguf(ValueError):
    """The bytes are not a GGUF header this reader understands."""


@attrs.frozen
class Shape:
    layers: int
    embedding: int
    heads: int
    kv_heads: int

    def kv_bytes_per_token(self, cache_type_k: str = "f16", cache_type_v: str = "f16") -> float:
        """What one token of context takes in llama.cpp's KV cache: K and V rows of every layer."""
        row = self.kv_heads * (self.embedding // max(self.heads, 1))
        k = CACHE_TYPE_BYTES.get(cache_type_k, 2.0)
        v = CACHE_TYPE_BYTES.get(cache_type_v, 2.0)
        return self.layers * row * (k + v)


def _read(file: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = file.read(size)
    if len(data) != size:
        raise NotGguf("the header ends early")
    return struct.unpack("<" + fmt, data)[0]


def _string(file: IO[bytes]) -> str:
    n = _read(file, "Q")
    data = file.read(n)
    if len(data) != n:
        raise NotGguf("the header ends early")
    return data.decode("utf-8", errors="replace")


def _value(file: IO[bytes], kind: int) -> Any:
    if kind in _FIXED:
        return _read(file, _FIXED[kind])
    if kind == _STRING:
        return _string(file)
    if kind == _ARRAY:
        item, n = _read(file, "I"), _read(file, "Q")
        if item in _FIXED:  # skipped whole: a vocabulary's scores, its token types
            file.seek(n * struct.calcsize("<" + _FIXED[item]), 1)
            return None
        for _ in range(n):
            _value(file, item)
        return None
    raise NotGguf(f"unknown value type {kind}")


def read_shape(file: IO[bytes]) -> Shape:
    """The model's shape from its header; NotGguf when it is not one (or lacks the keys)."""
    if file.read(4) != MAGIC:
        raise NotGguf("no GGUF magic")
    version = _read(file, "I")
    if version < 2:
        raise NotGguf(f"GGUF version {version}")
    _tensors, n_keys = _read(file, "Q"), _read(file, "Q")
    found: dict[str, Any] = {}
    for _ in range(n_keys):
        key = _string(file)
        found[key] = _value(file, _read(file, "I"))
    arch = found.get("general.architecture")
    try:
        heads = int(found[f"{arch}.attention.head_count"])
        return Shape(
            layers=int(found[f"{arch}.block_count"]),
            embedding=int(found[f"{arch}.embedding_length"]),
            heads=heads,
            kv_heads=int(found.get(f"{arch}.attention.head_count_kv", heads)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise NotGguf(f"no {exc} for architecture {arch!r}") from None
