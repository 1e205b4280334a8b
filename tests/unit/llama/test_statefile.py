"""supervisor/llama/statefile.py on slot files the real llama-server saved: the same prompt prefilled in two
slots reads back equal, layer for layer; another prompt does not; and the reader refuses what is not
a slot file.  scripts/slotdiff prints the same comparison."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import trio

from supervisor.llama import statefile
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
    errors = statefile.layer_errors(statefile.read(slot_files["a"]), statefile.read(slot_files["b"]))
    assert len(errors) == 30
    assert all(e.k == 0.0 and e.v == 0.0 for e in errors)


@pytest.mark.real
def test_another_prompt_differs_in_every_layer(slot_files: dict[str, Path]) -> None:
    a, other = statefile.read(slot_files["a"]), statefile.read(slot_files["other"])
    assert a.tokens != other.tokens
    errors = statefile.layer_errors(other, a)
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
    [error] = statefile.layer_errors(a, b)  # position 1 only: equal
    assert (error.k, error.v) == (0.0, 0.0)


def test_the_error_is_relative_to_the_reference() -> None:
    assert statefile.relative_error([3.0, 5.0], [0.0, 5.0]) == pytest.approx(3 / 5)
    assert statefile.relative_error([0.0], [0.0]) == 0.0


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
