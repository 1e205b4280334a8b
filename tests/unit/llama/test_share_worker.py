"""supervisor.llama.share_worker's state file parser and row writer, on state files built to its format.
(tests/real/test_real_share.py runs it on the real llama-server's files.)"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from supervisor.llama import share_worker
from supervisor.llama.region import JobRefused, StateRows, state_kinds, write_rows
from supervisor.llama.statefile import MAGIC as STATE_MAGIC
from supervisor.llama.statefile import VERSION as STATE_VERSION

ROW = 8
N_LAYER = 2
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8  # ggml/include/ggml.h


def row(kind: str, layer: int, pos: int) -> bytes:
    return bytes([ord(kind), layer, pos, 0xAB]) * (ROW // 4)


def state_file(
    positions: list[int],
    *,
    v_trans: int = 0,
    n_rot: int = 0,
    tail: bytes = b"",
    packed: bool = True,
    cell_ext: bool = False,
    n_layer: int = N_LAYER,
    v_type: int = GGML_F16,
) -> bytes:
    tokens = [100 + p for p in sorted(positions)]
    if packed:  # as llama-server writes its prompt: -1, version 1, count, tokens, media count 0
        tokens = [-1, 1, len(tokens), *tokens, 0]
    out = struct.pack("<III", STATE_MAGIC, STATE_VERSION, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    out += struct.pack("<II", 2, 0)  # two streams, the first empty
    out += struct.pack("<I", len(positions))
    for pos in positions:
        # An M-RoPE model's cell carries its 2D position and token between its count and its seq id.
        out += (
            struct.pack("<iI", pos, 1) + (struct.pack("<iii", pos, pos, 100 + pos) if cell_ext else b"") + b"\1\0\0\0"
        )
    out += struct.pack("<IIII", v_trans, n_layer, n_rot, n_rot)
    for kind, ggml_type in (("k", GGML_F16), ("v", v_type)):
        for layer in range(n_layer):
            out += struct.pack("<iQ", ggml_type, ROW)
            out += b"".join(row(kind, layer, pos) for pos in positions)
    return out + tail


def layout(n_cells: int) -> dict[str, Any]:
    """The patched llama-server's header for an f16 cache of N_LAYER layers (docs/protocol.md)."""
    size = n_cells * ROW
    tensors = [
        {
            "name": f"cache_{kind}_l{layer}",
            "layer": layer,
            "kind": kind,
            "type": "f16",
            "region": 0,
            "offset": i * size,
            "row_bytes": ROW,
        }
        for i, (layer, kind) in enumerate((layer, kind) for layer in range(N_LAYER) for kind in "kv")
    ]
    return {
        "n_layer": N_LAYER,
        "regions": [{"size": 4 * size}],
        "tensors": tensors,
        "n_rot_k": 0,
        "n_rot_v": 0,
        "v_trans": False,
    }


def test_rows_go_to_their_position_not_their_cell_index() -> None:
    # Cells as a wrapped ring holds them: positions 3, 4, then 0, 1, 2.
    positions = [3, 4, 0, 1, 2]
    state = StateRows(state_file(positions))
    assert state.tokens == [100, 101, 102, 103, 104]
    shape = layout(8)
    region = mmap.mmap(-1, shape["regions"][0]["size"])
    assert write_rows(state, shape, [region], 5) == (5, 0)
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
    assert write_rows(state, layout(8), [region], 4).n_tokens == 2


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


def test_a_header_without_types_or_layer_count_is_held_to_its_row_sizes_alone() -> None:
    # An older decoder's header (the fake llama-server's): nothing to compare the file's types with.
    shape = layout(8)
    del shape["n_layer"]
    for tensor in shape["tensors"]:
        del tensor["type"]
    state = StateRows(state_file([0, 1], v_type=GGML_Q8_0))
    assert write_rows(state, shape, [mmap.mmap(-1, shape["regions"][0]["size"])], 2) == (2, 0)


def test_rows_of_another_type_than_the_decoders_are_refused_though_as_long() -> None:
    # A q8_0 V row where the decoder's cache is f16: the same bytes a row, other values.
    state = StateRows(state_file([0, 1], v_type=GGML_Q8_0))
    region = mmap.mmap(-1, layout(8)["regions"][0]["size"])
    with pytest.raises(JobRefused, match="cache_v_l0: rows of type f16, the state file's q8_0"):
        write_rows(state, layout(8), [region], 2)
    assert region[:] == bytes(len(region))  # refused before a row was written


def test_a_row_type_the_worker_does_not_know_is_refused() -> None:
    state = StateRows(state_file([0, 1], v_type=41))
    with pytest.raises(JobRefused, match="ggml type 41, which this worker does not know"):
        write_rows(state, layout(8), [mmap.mmap(-1, layout(8)["regions"][0]["size"])], 2)


def test_a_kv_cache_of_another_layer_count_than_the_decoders_is_refused() -> None:
    # Three layers where the decoder lends two: the header's n_layer says so before its tensors are counted.
    state = StateRows(state_file([0, 1], n_layer=3))
    with pytest.raises(JobRefused, match="the decoder's KV cache has 2 layers, the state file's 3"):
        write_rows(state, layout(8), [mmap.mmap(-1, layout(8)["regions"][0]["size"])], 2)


def test_an_m_rope_models_cells_are_read_with_their_extension() -> None:
    state = StateRows(state_file([0, 1, 2], cell_ext=True))
    assert state.positions == [0, 1, 2]
    region = mmap.mmap(-1, layout(8)["regions"][0]["size"])
    assert write_rows(state, layout(8), [region], 3).n_tokens == 3
    assert region[ROW : 2 * ROW] == row("k", 0, 1)


# A hybrid model: two recurrent layers, each with an R row and an S row, after its KV part.
STATE_ROW = {"r": 12, "s": 20}
HYBRID_KINDS = ["r", "r", "s", "s"]


def state_row(kind: str, layer: int) -> bytes:
    return bytes([ord(kind), layer]) * (STATE_ROW[kind] // 2)


def hybrid_file(
    n: int,
    *,
    state_pos: int | None = None,
    cells: int = 1,
    s_row: int = STATE_ROW["s"],
    s_type: int = GGML_F32,
    n_layer: int = 4,
) -> bytes:
    out = state_file(list(range(n)))
    out += struct.pack("<I", cells)
    for _ in range(cells):
        out += struct.pack("<iI", n - 1 if state_pos is None else state_pos, 0)
    out += struct.pack("<II", 0, n_layer)  # s_trans, every layer's count
    for kind in "rs":
        for layer in (1, 3):
            size = s_row if kind == "s" else STATE_ROW[kind]
            ggml_type = s_type if kind == "s" else GGML_F32
            out += struct.pack("<iQ", ggml_type, size) + state_row(kind, layer)[:size] * cells
    return out


def hybrid_layout(n_cells: int) -> dict[str, Any]:
    shape = layout(n_cells)
    offset = 0
    for kind in "rs":
        for layer in (1, 3):
            shape["tensors"].append(
                {
                    "name": f"cache_{kind}_l{layer}",
                    "layer": layer,
                    "kind": kind,
                    "type": "f32",
                    "region": 1,
                    "offset": offset,
                    "row_bytes": STATE_ROW[kind],
                }
            )
            offset += STATE_ROW[kind]
    shape["regions"].append({"size": 4096, "state": True})
    return shape


def regions_for(shape: dict[str, Any]) -> list[mmap.mmap]:
    return [mmap.mmap(-1, int(region["size"])) for region in shape["regions"]]


def test_a_hybrids_recurrent_rows_go_to_the_staging_region_beside_its_kv() -> None:
    shape = hybrid_layout(8)
    assert state_kinds(shape) == HYBRID_KINDS
    state = StateRows(hybrid_file(5), HYBRID_KINDS)
    regions = regions_for(shape)
    assert write_rows(state, shape, regions, 5).n_tokens == 5
    for tensor in shape["tensors"]:
        if tensor["region"] == 1:
            at = tensor["offset"]
            assert regions[1][at : at + tensor["row_bytes"]] == state_row(tensor["kind"], int(tensor["name"][-1]))
    assert regions[0][ROW : 2 * ROW] == row("k", 0, 1)


def test_a_recurrent_state_from_another_position_is_refused() -> None:
    # The state after position 3 of a 5-token job: one token short, the decoder would decode from it.
    state = StateRows(hybrid_file(5, state_pos=3), HYBRID_KINDS)
    with pytest.raises(JobRefused, match="after position 3, not the job's last"):
        write_rows(state, hybrid_layout(8), regions_for(hybrid_layout(8)), 5)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (hybrid_file(3)[:-7], "ends at byte"),
        (hybrid_file(3, cells=2), "holds 2 cells"),
        (state_file([0, 1, 2]), "ends at byte"),
    ],
    ids=["torn-row", "two-cells", "no-recurrent-part"],
)
def test_a_torn_or_missing_recurrent_state_is_refused(data: bytes, said: str) -> None:
    with pytest.raises(JobRefused, match=said):
        StateRows(data, HYBRID_KINDS)


def test_a_recurrent_row_shorter_than_the_decoders_is_refused() -> None:
    state = StateRows(hybrid_file(3, s_row=16), HYBRID_KINDS)
    with pytest.raises(JobRefused, match="cache_s_l1: a row of 20 bytes, the state file's 16"):
        write_rows(state, hybrid_layout(8), regions_for(hybrid_layout(8)), 3)


def test_a_recurrent_row_of_another_type_than_the_decoders_is_refused() -> None:
    # An f16 S row (half the values) where the decoder keeps f32: refused by its type, not only its size.
    state = StateRows(hybrid_file(3, s_type=GGML_F16), HYBRID_KINDS)
    regions = regions_for(hybrid_layout(8))
    with pytest.raises(JobRefused, match="cache_s_l1: rows of type f32, the state file's f16"):
        write_rows(state, hybrid_layout(8), regions, 3)
    assert regions[1][:] == bytes(len(regions[1]))  # refused before a row was written


def test_a_recurrent_state_of_a_model_with_fewer_layers_than_the_decoders_rows_is_refused() -> None:
    # The state file's model has 3 layers; the decoder lends rows of its layer 3.
    state = StateRows(hybrid_file(3, n_layer=3), HYBRID_KINDS)
    with pytest.raises(JobRefused, match="cache_r_l3: layer 3 of a model the state file says has 3 layers"):
        write_rows(state, hybrid_layout(8), regions_for(hybrid_layout(8)), 3)


def test_a_row_kind_the_worker_does_not_know_is_refused_before_anything_is_read() -> None:
    shape = hybrid_layout(8)
    shape["tensors"][-1]["kind"] = "q"
    with pytest.raises(JobRefused, match="kind 'q'"):
        state_kinds(shape)


@pytest.mark.parametrize(
    ("data", "shape", "state_rows"),
    [(hybrid_file(5), hybrid_layout(8), 4), (state_file(list(range(5))), layout(8), 0)],
    ids=["hybrid", "dense"],
)
def test_the_workers_claim_names_the_recurrent_state_rows_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, shape: dict[str, Any], state_rows: int
) -> None:
    # onebitd adopts a hybrid's share only when the claim says every lent state row was written.
    saved = tmp_path / "share.state"
    saved.write_bytes(data)
    worker = share_worker.Worker("unused.sock", tmp_path)
    monkeypatch.setattr(worker, "_prefill_and_save", lambda job, name: (2.5, saved))
    fds = []
    try:
        for i, region in enumerate(shape["regions"]):
            fds.append(os.memfd_create(f"test-region-{i}", os.MFD_CLOEXEC))
            os.ftruncate(fds[-1], region["size"])
        answer = worker.share_job({"tokens": [100 + p for p in range(5)], "layout": shape}, fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert answer == {"n_tokens": 5, "state_rows": state_rows, "prefill_ms": 2.5}
    assert not saved.exists()
