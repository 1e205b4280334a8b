"""supervisor/llama/statefile.py on slot files the real llama-server saved: the same prompt prefilled in two
slots reads back equal, layer for layer; another prompt does not; and the reader refuses what is not
a slot file.  scripts/slotdiff prints the same comparison."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import trio

from supervisor.llama import statediff, statefile
from supervisor.llama.statefile import SlotState, StateFileError
from tests.rigs.rig import make_config, real_llama_server, run_daemon

ROOT = Path(__file__).resolve().parents[3]
DEADLINE_S = 240
PROMPT = "The list of words: " + ", ".join(f"word{i}" for i in range(30)) + "."
OTHER = "A list of numbers: " + ", ".join(str(i * 7) for i in range(30)) + "."


async def save_prefills(runtime: Path) -> dict[str, Path]:
    """PROMPT prefilled in slot 0 and again in slot 1, OTHER in slot 2; each slot saved."""
    real_llama_server()
    config = make_config(runtime, model={"parallel": 3, "ctx_size": 3072}, decoder={"threads": 2})
    saved: dict[str, Path] = {}
    async with run_daemon(config) as running:
        client = running.daemon.models.default.client
        for slot, (name, prompt) in enumerate([("a", PROMPT), ("b", PROMPT), ("other", OTHER)]):
            status, _ = await client.post_json(
                "/completion", {"prompt": prompt, "n_predict": 0, "id_slot": slot, "cache_prompt": True}
            )
            assert status == 200
            status, reply = await client.post_json(f"/slots/{slot}?action=save", {"filename": f"{name}.state"})
            assert status == 200, reply
            saved[name] = running.daemon.models.default.parts.state_dir / f"{name}.state"
        # The files outlive onebitd's runtime directory only if we move them out first.
        kept = {name: runtime.parent / f"{runtime.name}-{name}.state" for name in saved}
        for name, path in saved.items():
            path.rename(kept[name])
    return kept


@pytest.fixture(scope="module")
def slot_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runtime = tmp_path_factory.mktemp("statefile") / "rt"
    runtime.mkdir()

    async def run() -> dict[str, Path]:
        with trio.fail_after(DEADLINE_S):
            return await save_prefills(runtime)

    return trio.run(run)


@pytest.mark.real
def test_a_saved_slot_reads_back_as_its_tokens_and_every_layer(slot_files: dict[str, Path]) -> None:
    state = statefile.read(slot_files["a"])
    assert state.n_stream == 3  # llama-server without --kv-unified: a KV stream per slot
    assert state.n_cells > 20
    assert state.positions == tuple(range(state.n_cells))
    assert len(state.layers) == 30  # SmolLM2-135M
    for layer in state.layers:
        assert layer.k_width == layer.v_width == 192  # 3 KV heads of 64
        assert len(layer.k) == len(layer.v) == state.n_cells * 192
        assert any(x != 0.0 for x in layer.k)


@pytest.mark.real
def test_the_same_prompt_prefilled_twice_differs_nowhere(slot_files: dict[str, Path]) -> None:
    errors = statediff.layer_errors(statefile.read(slot_files["a"]), statefile.read(slot_files["b"]))
    assert len(errors) == 30
    assert all(e.k == 0.0 and e.v == 0.0 for e in errors)


@pytest.mark.real
def test_another_prompt_differs_in_every_layer(slot_files: dict[str, Path]) -> None:
    a, other = statefile.read(slot_files["a"]), statefile.read(slot_files["other"])
    assert a.tokens != other.tokens
    errors = statediff.layer_errors(other, a)
    assert all(e.k > 0.01 and e.v > 0.01 for e in errors)


@pytest.mark.real
def test_slotdiff_prints_each_layer(slot_files: dict[str, Path]) -> None:
    printed = subprocess.run(
        [ROOT / "scripts" / "slotdiff", slot_files["a"], slot_files["b"]],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    assert "tokens equal" in printed[0]
    assert printed[1].split() == ["layer", "K", "rel", "err", "V", "rel", "err"]
    assert [line.split()[0] for line in printed[2:32]] == [str(n) for n in range(30)]
    assert printed[32].split() == ["max", "0.00000", "0.00000"]


def state_bytes(*, v_trans: int, cells: list[tuple[int, list[float], list[float]]], cell_ext: bool = False) -> bytes:
    """A one-layer f32 slot file: each cell's position, K row and V row."""
    width = len(cells[0][1])
    out = struct.pack("<IIIi", statefile.MAGIC, statefile.VERSION, 1, 7)  # one token, 7
    out += struct.pack("<II", 1, len(cells))
    for pos, _, _ in cells:
        out += (
            struct.pack("<iI", pos, 1) + (bytes(statefile.CELL_EXT_BYTES) if cell_ext else b"") + struct.pack("<i", 0)
        )
    out += struct.pack("<IIII", v_trans, 1, 0, 0)
    out += struct.pack("<iQ", statefile.GGML_F32, 4 * width) + b"".join(
        struct.pack(f"<{width}f", *k) for _, k, _ in cells
    )
    if v_trans:
        out += struct.pack("<iII", statefile.GGML_F32, 4, width)
        out += b"".join(struct.pack(f"<{len(cells)}f", *(v[j] for _, _, v in cells)) for j in range(width))
    else:
        out += struct.pack("<iQ", statefile.GGML_F32, 4 * width) + b"".join(
            struct.pack(f"<{width}f", *v) for _, _, v in cells
        )
    return out


CELLS = [(0, [1.0, 2.0], [3.0, 4.0]), (1, [5.0, 6.0], [7.0, 8.0])]


def rows(state: SlotState) -> tuple[list[float], list[float]]:
    return list(state.layers[0].k), list(state.layers[0].v)


def test_a_transposed_v_reads_back_cell_major() -> None:
    assert rows(statefile.parse(state_bytes(v_trans=1, cells=CELLS))) == ([1, 2, 5, 6], [3, 4, 7, 8])
    assert rows(statefile.parse(state_bytes(v_trans=0, cells=CELLS))) == ([1, 2, 5, 6], [3, 4, 7, 8])


def test_cells_with_the_extension_of_m_rope_models_are_read_too() -> None:
    state = statefile.parse(state_bytes(v_trans=0, cells=CELLS, cell_ext=True))
    assert state.positions == (0, 1)
    assert rows(state) == ([1, 2, 5, 6], [3, 4, 7, 8])


def test_cells_are_compared_by_position() -> None:
    a = statefile.parse(state_bytes(v_trans=0, cells=CELLS))
    b = statefile.parse(state_bytes(v_trans=0, cells=[CELLS[1], (2, [9.0, 9.0], [9.0, 9.0])]))
    [error] = statediff.layer_errors(a, b)  # position 1 only: equal
    assert (error.k, error.v) == (0.0, 0.0)


def test_the_error_is_relative_to_the_reference() -> None:
    assert statediff.relative_error([3.0, 5.0], [0.0, 5.0]) == pytest.approx(3 / 5)
    assert statediff.relative_error([0.0], [0.0]) == 0.0


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"GGUF" + bytes(40), "magic"),
        (struct.pack("<III", statefile.MAGIC, 3, 0), "version 3"),
        (state_bytes(v_trans=0, cells=CELLS)[:-3], "truncated"),
        (state_bytes(v_trans=0, cells=CELLS) + b"x", "left over"),
    ],
)
def test_what_is_not_a_slot_file_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(StateFileError, match=why):
        statefile.parse(data)


def kv_part(cells: list[tuple[int, list[float], list[float]]]) -> bytes:
    """One KV cache of one f32 layer, its cells in one stream."""
    width = len(cells[0][1])
    out = struct.pack("<II", 1, len(cells))
    out += b"".join(struct.pack("<iIi", pos, 1, 0) for pos, _, _ in cells)
    out += struct.pack("<IIII", 0, 1, 0, 0)
    for rows in ([k for _, k, _ in cells], [v for _, _, v in cells]):
        out += struct.pack("<iQ", statefile.GGML_F32, 4 * width)
        out += b"".join(struct.pack(f"<{width}f", *row) for row in rows)
    return out


def recurrent_part(pos: int, r: list[float], s: list[float], *, n_layer: int = 2) -> bytes:
    """A recurrent memory of one cell and one recurrent layer (of ``n_layer``): its R, then its S."""
    out = struct.pack("<iIi", 1, pos, 0) + struct.pack("<II", 0, n_layer)
    for rows in (r, s):
        out += struct.pack("<iQ", statefile.GGML_F32, 4 * len(rows)) + struct.pack(f"<{len(rows)}f", *rows)
    return out


def state_of(*parts: bytes) -> bytes:
    return struct.pack("<IIIi", statefile.MAGIC, statefile.VERSION, 1, 7) + b"".join(parts)


def test_a_sliding_window_models_two_caches_are_read_as_its_base_and_its_window() -> None:
    state = statefile.parse(state_of(kv_part(CELLS), kv_part(CELLS[1:])))
    assert [(c.name, c.positions) for c in state.caches] == [("kv base", (0, 1)), ("kv swa", (1,))]
    assert state.recurrent is None


@pytest.mark.parametrize("swa", [False, True], ids=["hybrid", "hybrid-with-window"])
def test_a_hybrid_models_recurrent_memory_is_read_after_its_kv_cache(swa: bool) -> None:
    kv = [kv_part(CELLS), kv_part(CELLS[1:])] if swa else [kv_part(CELLS)]
    state = statefile.parse(state_of(*kv, recurrent_part(1, [1.0, 2.0, 3.0], [4.0])))
    assert [c.name for c in state.caches] == (["kv base", "kv swa"] if swa else ["kv"])
    assert state.recurrent is not None
    assert state.recurrent.positions == (1,)
    [r], [s] = state.recurrent.r, state.recurrent.s
    assert (list(r.values), r.width, list(s.values), s.width) == ([1.0, 2.0, 3.0], 3, [4.0], 1)


def test_a_recurrent_memory_one_position_off_is_flagged_by_its_cells_and_its_values() -> None:
    own = statefile.parse(state_of(kv_part(CELLS), recurrent_part(1, [1.0, 2.0], [3.0])))
    short = statefile.parse(state_of(kv_part(CELLS[:1]), recurrent_part(0, [2.0, 2.0], [1.0])))
    comparison = statediff.compare(short, own)
    assert comparison.differences == (
        "kv: cells at 0..0 (1) against 0..1 (2)",
        "recurrent: cells at 0..0 (1) against 1..1 (1)",
    )
    assert comparison.worst("K") == comparison.worst("V") == 0.0  # position 0 holds the same in both
    assert comparison.worst("R") == pytest.approx(statediff.relative_error([2.0, 2.0], [1.0, 2.0]))
    assert comparison.worst("S") == pytest.approx(2 / 3)
    same = statediff.compare(own, own)
    assert (same.differences, same.max_error, len(same.errors)) == ((), 0.0, 4)  # K, V, R, S


def test_states_of_two_memories_are_not_compared() -> None:
    dense = statefile.parse(state_of(kv_part(CELLS)))
    hybrid = statefile.parse(state_of(kv_part(CELLS), recurrent_part(1, [1.0], [1.0])))
    with pytest.raises(StateFileError, match="kv against kv \\+ recurrent: not the same memory"):
        statediff.compare(dense, hybrid)


def test_slotdiff_prints_each_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.state", tmp_path / "b.state"
    a.write_bytes(state_of(kv_part(CELLS), recurrent_part(1, [1.0, 2.0], [3.0])))
    b.write_bytes(state_of(kv_part(CELLS), recurrent_part(2, [1.0, 2.0], [6.0])))
    assert statediff.main([str(a), str(b)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:] == [
        "layer  K rel err  V rel err",
        "    0    0.00000    0.00000",
        "  max    0.00000    0.00000",
        "recurrent: layer  R rel err  S rel err",
        "    0    0.00000    0.50000",
        "  max    0.00000    0.50000",
        "differ: recurrent: cells at 1..1 (1) against 2..2 (1)",
    ]


@pytest.mark.parametrize("v_trans", [0, 1])
def test_read_without_the_kv_values_a_state_keeps_its_cells_and_its_recurrent_memory(v_trans: int) -> None:
    kv = state_bytes(v_trans=v_trans, cells=CELLS)
    lean = statefile.parse(kv, kv_values=False)
    assert lean.positions == (0, 1)
    assert (list(lean.layers[0].k), list(lean.layers[0].v), lean.layers[0].k_width) == ([], [], 2)
    own = state_of(kv_part(CELLS), recurrent_part(1, [1.0, 2.0], [3.0]))
    other = state_of(kv_part(CELLS[:1]), recurrent_part(1, [1.0, 2.0], [6.0]))
    comparison = statediff.compare(
        statefile.parse(other, kv_values=False), statefile.parse(own, kv_values=False), kv=False
    )
    assert comparison.differences == ("kv: cells at 0..0 (1) against 0..1 (2)",)
    assert [(e.tensor, e.error) for e in comparison.errors] == [("R", 0.0), ("S", 1.0)]
