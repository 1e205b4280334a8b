"""A GGUF header read for the numbers that size a model's KV cache."""

from __future__ import annotations

import io
import struct

import pytest

from supervisor.config import locate
from supervisor.llama import gguf
from supervisor.routes.completion import STATE_BYTES_PER_TOKEN


def test_the_shipped_model_takes_per_token_what_its_slot_state_files_take() -> None:
    path = locate.embedded_model()
    assert path is not None
    with open(path, "rb") as file:
        shape = gguf.read_shape(file)
    assert shape == gguf.Shape(layers=30, embedding=576, heads=9, kv_heads=3, context_length=8192)
    assert shape.kv_bytes_per_token() == STATE_BYTES_PER_TOKEN
    assert shape.kv_bytes_per_token("q8_0", "q8_0") < STATE_BYTES_PER_TOKEN


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_a_header_without_the_architecture_keys_is_not_a_shape() -> None:
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("general.architecture") + struct.pack("<I", 8)
    header += _string("llama")
    with pytest.raises(gguf.NotGguf, match="llama"):
        gguf.read_shape(io.BytesIO(header))


@pytest.mark.parametrize("data", [b"", b"GGML", b"GGUF\x03\x00\x00\x00\x00"], ids=["empty", "magic", "short"])
def test_what_is_no_gguf_header_is_refused(data: bytes) -> None:
    with pytest.raises(gguf.NotGguf):
        gguf.read_shape(io.BytesIO(data))
