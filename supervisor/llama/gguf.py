"""A GGUF file's header: the few metadata numbers that size a model's caches and say what its
memory is made of (attention, sliding-window attention, recurrent layers).

Bring-your-own-bytes, as h11 reads HTTP: :func:`read_shape` reads the header's key/value section
from a binary file object and returns a :class:`Shape`; nothing else of the file (its tensors) is
read.  Layout: ggml's docs/gguf.md (magic, version, tensor and key counts, then typed key/value
pairs, little-endian).  Hybrid models give some numbers per layer (LFM2's and Granite 4's
``head_count_kv``, a 0 for each layer that is not attention): small integer arrays are read, every
other array skipped.
"""

from __future__ import annotations

import os
import struct
from typing import IO, Any

import attrs

MAGIC = b"GGUF"
# Value types (gguf.md's gguf_metadata_value_type): fixed-size ones by struct format.
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Arrays of integers this long or shorter are read (per-layer numbers); longer ones are skipped.
_PER_LAYER_MAX = 4096
_INTEGERS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
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


def _ints(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    return None


@attrs.frozen
class Shape:
    """What sizes a model's caches.  ``kv_heads`` is per layer where the GGUF says so (0: a layer
    with no attention, a recurrent or convolution one), else one number for every layer."""

    layers: int
    embedding: int
    heads: int
    kv_heads: int | tuple[int, ...]
    # The model's training context (``<arch>.context_length``): llama-server caps a slot there.
    context_length: int | None = None
    # Sliding-window attention's window (``<arch>.attention.sliding_window``), None without one.
    sliding_window: int | None = None
    # Its layers that slide (``sliding_window_pattern``, where it says per layer; else every
    # attention layer when it has a window: what is sized from it then errs large).
    swa_layers: int = 0
    # Layers of recurrent state (``<arch>.attention.recurrent_layers``, or the layers without
    # attention); and one sequence's recurrent state in f32 values (Mamba-2 / gated delta-net:
    # its conv window and its SSM state; LFM2's short convolution: its cache).
    recurrent_layers: int = 0
    recurrent_values: int = 0
    # One attention head's K and V widths (``attention.key_length``, ``attention.value_length``);
    # None: ``embedding / heads``.  Qwen3.5's and Gemma's heads are wider than that.
    key_length: int | None = None
    value_length: int | None = None

    @property
    def attention_layers(self) -> int:
        if isinstance(self.kv_heads, tuple):
            return sum(1 for h in self.kv_heads if h > 0)
        return self.layers - self.recurrent_layers

    @property
    def hybrid(self) -> bool:
        """Some of its memory is recurrent: a state cannot be cut back to an earlier token."""
        return self.recurrent_layers > 0

    @property
    def memory(self) -> str:
        """Its memory's parts as llama.cpp makes them, ``+``-joined: ``kv`` (attention), ``swa`` (a
        sliding-window KV cache beside it), ``recurrent`` (recurrent or convolution state): a
        Qwen3.5's is ``kv+recurrent``.  A ``kv`` and a ``kv+recurrent`` can be lent on the share route."""
        parts = ["kv"] if self.attention_layers else []
        if self.sliding_window is not None:
            parts.append("swa")
        if self.hybrid:
            parts.append("recurrent")
        return "+".join(parts)

    def kv_bytes_per_token(self, cache_type_k: str = "f16", cache_type_v: str = "f16") -> float:
        """What one token of context takes in llama.cpp's KV cache: K and V rows of every
        attention layer."""
        kv_heads = max(self.kv_heads) if isinstance(self.kv_heads, tuple) else self.kv_heads
        head = self.embedding // max(self.heads, 1)
        k = kv_heads * (self.key_length or head) * CACHE_TYPE_BYTES.get(cache_type_k, 2.0)
        v = kv_heads * (self.value_length or head) * CACHE_TYPE_BYTES.get(cache_type_v, 2.0)
        return self.attention_layers * (k + v)

    def recurrent_bytes(self) -> float:
        """One sequence's recurrent state (f32, llama.cpp's default for it), over its layers."""
        return self.recurrent_layers * self.recurrent_values * 4.0


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
        if item in _INTEGERS and n <= _PER_LAYER_MAX:
            return [_read(file, _FIXED[item]) for _ in range(n)]
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
        return _shape(arch, found)
    except (KeyError, TypeError, ValueError) as exc:
        raise NotGguf(f"no {exc} for architecture {arch!r}") from None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _shape(arch: Any, found: dict[str, Any]) -> Shape:
    def key(name: str, default: Any = None) -> Any:
        return found.get(f"{arch}.{name}", default)

    layers = int(found[f"{arch}.block_count"])
    heads_per_layer = _ints(found[f"{arch}.attention.head_count"])
    if not heads_per_layer:
        raise KeyError(f"{arch}.attention.head_count")
    heads = max(heads_per_layer)
    kv = _ints(key("attention.head_count_kv", heads)) or (heads,)
    window = _positive(key("attention.sliding_window"))
    pattern = _ints(key("attention.sliding_window_pattern"))
    swa = 0
    if window is not None:
        swa = sum(1 for flag in pattern if flag) if pattern is not None and len(pattern) == layers else layers
    recurrent = _recurrent_layers(arch, layers, kv, key)
    return Shape(
        layers=layers,
        embedding=int(found[f"{arch}.embedding_length"]),
        heads=heads,
        kv_heads=kv if len(kv) > 1 else kv[0],
        context_length=_positive(key("context_length")),
        sliding_window=window,
        swa_layers=swa,
        recurrent_layers=recurrent,
        recurrent_values=_recurrent_values(key) if recurrent else 0,
        key_length=_positive(key("attention.key_length")),
        value_length=_positive(key("attention.value_length")),
    )


# The gated delta-net architectures whose GGUF may say which layers are full attention only by an
# interval (llama.cpp's src/models/qwen35.cpp and its kin: every ``full_attention_interval``-th
# layer, 4 without the key; the next-token-prediction layers past the trunk are attention).
_INTERVAL_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe", "minimax-01"})


def _recurrent_layers(arch: Any, layers: int, kv: tuple[int, ...], key: Any) -> int:
    """How many layers keep a recurrent state rather than KV, as llama.cpp marks them: the
    ``attention.recurrent_layers`` flags where the GGUF has them; for the interval architectures
    every layer of the trunk but each ``full_attention_interval``-th; else the layers without KV
    heads (LFM2, Granite 4: a per-layer ``head_count_kv`` of 0)."""
    flags = _ints(key("attention.recurrent_layers"))
    if flags is not None and len(flags) == layers:
        return sum(1 for flag in flags if flag)
    if arch in _INTERVAL_ARCHS:
        interval = _positive(key("full_attention_interval")) or 4
        trunk = layers - (_positive(key("nextn_predict_layers")) or 0)
        return sum(1 for i in range(trunk) if (i + 1) % interval != 0)
    return sum(1 for h in kv if h == 0) if len(kv) > 1 else 0


def _recurrent_values(key: Any) -> int:
    """One sequence's recurrent state per layer, in values, as llama.cpp sizes it: a Mamba-2 /
    gated delta-net layer keeps its conv window ``(d_conv - 1) x (d_inner + 2 x groups x d_state)``
    and its state ``d_state x d_inner``; LFM2's short convolution ``(l_cache - 1) x n_embd``."""
    inner = _positive(key("ssm.inner_size")) or 0
    state = _positive(key("ssm.state_size")) or 0
    conv = _positive(key("ssm.conv_kernel")) or 0
    groups = _positive(key("ssm.group_count")) or 0
    l_cache = _positive(key("shortconv.l_cache")) or 0
    if inner and conv:
        return (conv - 1) * (inner + 2 * groups * state) + state * inner
    if l_cache:
        return (l_cache - 1) * int(key("embedding_length", 0))
    return 0


# ggml's block sizes by tensor type id (ggml.h's ggml_type): (bytes, values) of one block, for the
# types GGUF files commonly hold; a tensor of another type is bounded by its offset alone.
_BLOCKS = {
    0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32), 9: (36, 32),
    10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256), 15: (292, 256),
    24: (1, 1), 25: (2, 1), 26: (4, 1), 27: (8, 1), 28: (8, 1), 30: (2, 1), 39: (17, 32),
}  # fmt: skip


def problem(file: IO[bytes], size: int) -> str | None:
    """What makes ``file`` (``size`` bytes) no model llama.cpp can load, as far as its header says:
    not a GGUF, a header that ends early, no architecture, or tensor data past the file's end (a
    truncated download); None when the header holds.  An architecture this llama.cpp lacks is known
    only to llama-server (its load says so, and the decoder fails at once)."""
    try:
        if file.read(4) != MAGIC:
            return "not a GGUF file (no GGUF magic)"
        version = _read(file, "I")
        if version < 2:
            return f"GGUF version {version}, which llama.cpp no longer reads"
        n_tensors, n_keys = _read(file, "Q"), _read(file, "Q")
        found: dict[str, Any] = {}
        for _ in range(n_keys):
            key = _string(file)
            found[key] = _value(file, _read(file, "I"))
        if not isinstance(found.get("general.architecture"), str):
            return "the GGUF header names no general.architecture"
        end = 0
        for _ in range(n_tensors):
            _string(file)
            dims = [_read(file, "Q") for _ in range(_read(file, "I"))]
            kind, offset = _read(file, "I"), _read(file, "Q")
            values = 1
            for dim in dims:
                values *= dim
            block_bytes, block_values = _BLOCKS.get(kind, (0, 1))
            end = max(end, offset + values // block_values * block_bytes)
    except NotGguf as exc:
        return f"{exc}: a truncated file"
    alignment = found.get("general.alignment")
    align = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = -(-file.tell() // align) * align
    if n_tensors and data_start + end > size:
        return f"its tensor data ends at byte {data_start + end}, past the file's {size}: a truncated file"
    return None


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """:func:`problem` of the file at ``path`` (an unreadable file says why)."""
    try:
        with open(path, "rb") as file:
            return problem(file, os.fstat(file.fileno()).st_size)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
