"""A model's memory estimate (supervisor/models/memory.py) against what the real llama-server
allocates: per family, its KV cache and its recurrent or convolution state as llama-server's own
log sizes them (``llama_kv_cache: size = ...``, ``llama_memory_recurrent: size = ...``), and for
SmolLM2 the resident memory that a larger context adds.  The tiny models' states are small, so the
buffers are compared to the log's 0.01 MiB, not through the process's RSS."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from supervisor.config import locate
from supervisor.config.schema import ModelConfig
from supervisor.llama import gguf
from supervisor.llama.llama_server import model_args
from supervisor.models import memory
from tests.real.test_real_families import model_file, tiny_models  # noqa: F401 (a fixture)
from tests.rigs.rig import real_llama_server

pytestmark = pytest.mark.real

DEADLINE_S = 60
MIB = 1024 * 1024
# What each cache of llama-server says it takes, in MiB (two decimals).
_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")
_RECURRENT = re.compile(r"llama_memory_recurrent: size =\s*([\d.]+) MiB")
# Each checkpoint it takes of a slot (server-context.cpp's create_checkpoint, at trace level).
_CHECKPOINT = re.compile(r"created context checkpoint (\d+) of (\d+) \(.*?size = ([\d.]+) MiB\)")
_LISTENING = re.compile(r"listening on (http://[\d.:]+)")


@contextlib.asynccontextmanager
async def serving(model: Path, table: ModelConfig) -> AsyncIterator[tuple[str, bytearray, int]]:
    """llama-server on ``model`` with the decoder's model flags for ``table`` (on a port the system
    picks, its log at trace level), once it listens: its URL, its log as it grows, and its pid.
    Killed and reaped on the way out (nothing of it is kept: no graceful stop to wait for)."""
    args = [str(real_llama_server()), *model_args(table, model), "-t", "1", "--port", "0", "-lv", "4"]
    process = await trio.lowlevel.open_process(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert process.stdout is not None
    stdout = process.stdout
    log = bytearray()
    listening = trio.Event()

    async def read() -> None:  # to its end: a full pipe would stall llama-server's verbose log
        async for chunk in stdout:
            log.extend(chunk)
            if b"listening on" in log:
                listening.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        try:
            with trio.fail_after(DEADLINE_S):
                await listening.wait()
            found = _LISTENING.search(log.decode(errors="replace"))
            assert found is not None, log.decode(errors="replace")[-2000:]
            yield found.group(1), log, process.pid
        finally:
            process.kill()
            with trio.fail_after(DEADLINE_S):
                await process.wait()


async def loaded(model: Path, table: ModelConfig) -> tuple[str, float]:
    """Start llama-server on ``model`` with the decoder's model flags for ``table``, read its log
    until it listens, and return the log and its resident MiB then."""
    async with serving(model, table) as (_, log, pid):
        rss = memory.rss_mib(pid)
    assert rss is not None, log.decode(errors="replace")[-2000:]
    return log.decode(errors="replace"), rss


def shape_of(path: Path) -> gguf.Shape:
    with path.open("rb") as file:
        return gguf.read_shape(file)


def said(pattern: re.Pattern[str], log: str) -> float:
    """The MiB llama-server's log gives a cache, summed over its caches (an iSWA model has two)."""
    return sum(float(m) for m in pattern.findall(log))


@pytest.mark.parametrize(
    "name",
    ["llama-dense", "gemma3-dense", "qwen35-dense", "qwen35moe-moe", "granitehybrid-dense", "lfm2-dense"],
)
async def test_the_estimate_sizes_each_cache_as_llama_server_allocates_it(
    tiny_models: Path,  # noqa: F811
    name: str,
) -> None:
    """Only the attention layers keep KV; a hybrid's recurrent or convolution state is a cell a
    slot.  Each part of the estimate is the buffer llama-server reports, to its log's rounding."""
    path = model_file(tiny_models, name)
    shape = shape_of(path)
    table = ModelConfig(path=str(path), ctx_size=4096, parallel=2)
    log, _ = await loaded(path, table)
    kv = memory.kv_cache_bytes(shape, table, swa_full=False) / MIB
    recurrent = memory.recurrent_cache_bytes(shape, table) / MIB
    assert said(_KV, log) == pytest.approx(kv, abs=0.01), log
    assert said(_RECURRENT, log) == pytest.approx(recurrent, abs=0.01), log
    assert (recurrent > 0) == shape.hybrid
    if name != "lfm2-dense":  # its convolution state, 4 KiB, rounds to 0.00 MiB in the log
        assert (_RECURRENT.search(log) is not None) == shape.hybrid


async def test_what_a_larger_context_adds_to_the_resident_memory_is_its_estimated_kv() -> None:
    """SmolLM2's KV at 2048 and 16384 tokens of context (two slots): the resident memory the larger
    one adds is the estimate's difference, within 15% (llama.cpp clears its KV buffers, so they are
    resident; the compute buffers differ a little by context)."""
    path = locate.embedded_model()
    assert path is not None
    shape = shape_of(path)
    small = ModelConfig(path=str(path), ctx_size=2048, parallel=2)
    large = ModelConfig(path=str(path), ctx_size=16384, parallel=2)
    _, small_rss = await loaded(path, small)
    log, large_rss = await loaded(path, large)
    estimated = (
        memory.cache_bytes(shape, large, swa_full=False) - memory.cache_bytes(shape, small, swa_full=False)
    ) / MIB
    assert said(_KV, log) == pytest.approx(memory.kv_cache_bytes(shape, large, swa_full=False) / MIB, abs=0.01)
    assert large_rss - small_rss == pytest.approx(estimated, rel=0.15)


@pytest.mark.parametrize(
    ("name", "kept"),
    [("qwen35-dense", memory.CTX_CHECKPOINTS - 1), ("gemma3-dense", memory.CTX_CHECKPOINTS - 1), ("lfm2-dense", 1)],
    ids=["recurrent", "swa", "swa+recurrent"],
)
async def test_a_slot_keeps_at_most_the_context_checkpoints_the_estimate_counts_each_within_its_share(
    tiny_models: Path,  # noqa: F811
    name: str,
    kept: int,
) -> None:
    """One slot's conversation, a turn longer each time, with the decoder's model flags (onebit
    passes no --ctx-checkpoints): llama-server takes a checkpoint or two a turn, each of the slot's
    state that cannot be cut back, and keeps at most as many as the estimate counts.  ``kept``: the
    most it held (short of the count, it thins those within --checkpoint-min-step of each other
    before it would make the last; LFM2's sliding window leaves one usable).  Each is the
    estimate's to the log's 0.001 MiB (and the cells' positions): the recurrent state, the
    window's cells."""
    path = model_file(tiny_models, name)
    shape = shape_of(path)
    table = ModelConfig(path=str(path), ctx_size=4096, parallel=1)
    one = memory.checkpoint_bytes(shape, table, swa_full=False, checkpoints=1) / MIB
    prompt = " ".join(f"item {i} weighs {i * 7 % 13} units" for i in range(40))
    async with serving(path, table) as (url, log, _), httpx.AsyncClient(base_url=url, timeout=60) as client:
        for turn in range(memory.CTX_CHECKPOINTS + 3):
            prompt += f" and turn {turn} asks again"
            body = {"prompt": prompt, "n_predict": 1, "temperature": 0, "id_slot": 0}
            with trio.fail_after(DEADLINE_S):
                reply = await client.post("/completion", json=body)
            assert reply.status_code == 200, reply.text
    taken = _CHECKPOINT.findall(log.decode(errors="replace"))
    assert taken, log.decode(errors="replace")[-3000:]
    assert {int(of) for _, of, _ in taken} == {memory.ctx_checkpoints([])}
    assert max(int(n) for n, _, _ in taken) == kept
    sizes = [float(size) for _, _, size in taken]
    assert sizes == pytest.approx([one] * len(sizes), abs=0.0015), one
