"""A GGUF header read for the numbers that size a model's KV cache."""

from __future__ import annotations

import io
import struct
from pathlib import Path

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


def test_a_model_file_whose_tensors_run_past_its_end_is_a_truncated_file(tmp_path: Path) -> None:
    path = locate.embedded_model()
    assert path is not None
    assert gguf.file_problem(path) is None
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 4096])
    said = gguf.file_problem(cut)
    assert said is not None
    assert said.endswith(f"past the file's {len(whole) - 4096}: a truncated file")
    cut.write_bytes(whole[:4096])
    assert gguf.file_problem(cut) == "the header ends early: a truncated file"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"", "not a GGUF file (no GGUF magic)"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1, which llama.cpp no longer reads"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 0), "the GGUF header names no general.architecture"),
    ],
    ids=["empty", "old", "no-architecture"],
)
def test_what_llama_cpp_cannot_load_is_named(data: bytes, said: str) -> None:
    assert gguf.problem(io.BytesIO(data), len(data)) == said


@pytest.mark.parametrize(
    ("shape", "memory"),
    [
        (gguf.Shape(layers=4, embedding=64, heads=4, kv_heads=2), "kv"),
        (gguf.Shape(layers=4, embedding=64, heads=4, kv_heads=2, sliding_window=32, swa_layers=3), "kv+swa"),
        (gguf.Shape(layers=4, embedding=64, heads=4, kv_heads=(2, 0, 0, 2), recurrent_layers=2), "kv+recurrent"),
        (
            gguf.Shape(layers=4, embedding=64, heads=4, kv_heads=(2, 0, 2, 0), sliding_window=32, recurrent_layers=2),
            "kv+swa+recurrent",
        ),
        (gguf.Shape(layers=4, embedding=64, heads=4, kv_heads=0, recurrent_layers=4), "recurrent"),
    ],
    ids=["dense", "sliding-window", "hybrid", "lfm2", "mamba"],
)
def test_a_shape_names_the_memory_layout_llama_cpp_makes_of_it(shape: gguf.Shape, memory: str) -> None:
    # The share route's refusal names it on the route line (docs/operations.md's `memory`).
    assert shape.memory == memory
