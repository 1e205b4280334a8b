"""supervisor.llama.share_worker's state file parser and row writer, on state files built to its format.
(tests/real/test_real_share.py runs it on the real llama-server's files.)"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import pytest

from supervisor.llama.region import JobRefused, StateRows, write_rows
from supervisor.llama.statefile import MAGIC as STATE_MAGIC
from supervisor.llama.statefile import VERSION as STATE_VERSION

ROW = 8
N_LAYER = 2


def row(kind: str, layer: int, pos: int) -> bytes:
    return bytes([ord(kind), layer, pos, 0xAB]) * (ROW // 4)


def state_file(
    positions: list[int], *, v_trans: int = 0, n_rot: int = 0, tail: bytes = b"", packed: bool = True
) -> bytes:
    tokens = [100 + p for p in sorted(positions)]
    if packed:  # as llama-server writes its prompt: -1, version 1, count, tokens, media count 0
        tokens = [-1, 1, len(tokens), *tokens, 0]
    out = struct.pack("<III", STATE_MAGIC, STATE_VERSION, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    out += struct.pack("<II", 2, 0)  # two streams, the first empty
    out += struct.pack("<I", len(positions))
    for pos in positions:
        out += struct.pack("<iIi", pos, 1, 1)
    out += struct.pack("<IIII", v_trans, N_LAYER, n_rot, n_rot)
    for kind in "kv":
        for layer in range(N_LAYER):
            out += struct.pack("<iQ", 1, ROW)
            out += b"".join(row(kind, layer, pos) for pos in positions)
    return out + tail


def layout(n_cells: int) -> dict[str, Any]:
    size = n_cells * ROW
    tensors = [
        {"name": f"cache_{kind}_l{layer}", "kind": kind, "region": 0, "offset": i * size, "row_bytes": ROW}
        for i, (layer, kind) in enumerate((layer, kind) for layer in range(N_LAYER) for kind in "kv")
    ]
    return {"regions": [{"size": 4 * size}], "tensors": tensors, "n_rot_k": 0, "n_rot_v": 0, "v_trans": False}


def test_rows_go_to_their_position_not_their_cell_index() -> None:
    # Cells as a wrapped ring holds them: positions 3, 4, then 0, 1, 2.
    positions = [3, 4, 0, 1, 2]
    state = StateRows(state_file(positions))
    assert state.tokens == [100, 101, 102, 103, 104]
    shape = layout(8)
    region = mmap.mmap(-1, shape["regions"][0]["size"])
    assert write_rows(state, shape, [region], 5) == 5
    for tensor in shape["tensors"]:
        layer = int(tensor["name"][-1])
        for pos in range(5):
            at = tensor["offset"] + pos * ROW
            assert region[at : at + ROW] == row(tensor["kind"], layer, pos)
        # Nothing past the job's positions.
        assert region[tensor["offset"] + 5 * ROW : tensor["offset"] + 8 * ROW] == bytes(3 * ROW)


def test_a_plain_token_list_is_read_as_the_tokens() -> None:
    assert StateRows(state_file([1, 0], packed=False)).tokens == [100, 101]


def test_the_claim_stops_at_the_first_missing_position() -> None:
    state = StateRows(state_file([0, 1, 3]))
    region = mmap.mmap(-1, layout(8)["regions"][0]["size"])
    assert write_rows(state, layout(8), [region], 4) == 2


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (state_file([0, 1], v_trans=1), "transposed"),
        (state_file([0, 1], tail=b"\0" * 12), "bytes after the last field"),
        (state_file([0, 1])[:-3], "ends at byte"),
        (b"GGUF" + bytes(20), "slot state file"),
    ],
    ids=["transposed", "cells-with-extra-data", "truncated", "not-a-state-file"],
)
def test_a_state_file_of_another_shape_is_refused(data: bytes, said: str) -> None:
    with pytest.raises(JobRefused, match=said):
        StateRows(data)


def test_a_rotation_that_differs_from_the_decoders_is_refused() -> None:
    state = StateRows(state_file([0, 1], n_rot=64))
    region = mmap.mmap(-1, layout(8)["regions"][0]["size"])
    with pytest.raises(JobRefused, match="rotates"):
        write_rows(state, layout(8), [region], 2)
