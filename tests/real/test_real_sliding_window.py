"""A sliding-window model whose window is wider than the restore probe's prompt, through onebitd on
the real llama-server (issue 53): the tiny gemma3 (scripts/tiny-models) with its window raised from
32 to 512 tokens.

Without ``--swa-full`` the decoder keeps only the window's cells, and a restored state is
re-evaluated whole even for the probe's 160-token prompt, inside the window (measured: 160 of 160):
the load's probe (supervisor/routes/capability.py) judges it ``none``.  Under ``swa_full = "auto"``
the decoder keeps every cell, and every route serves a prompt past the window with the decoder
evaluating a token or two: the file route's handoff, the plain route's restore from the prefix
store after a restart, and the share route's refusal (an SWA memory is not lent), which goes on by
the file route.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from supervisor.routes.capability import Restores
from supervisor.supervise.child import ChildState
from tests.real.test_real_families import (  # noqa: F401 (tiny_models and store_dir: fixtures)
    DEADLINE_S,
    ask,
    config,
    jobs,
    kept_files,
    model_file,
    share_config,
    store_dir,
    tiny_models,
)
from tests.rigs.helpers import wait_until
from tests.rigs.rig import TESTS, RouteLines, child_of, run_daemon

pytestmark = pytest.mark.real

WINDOW = 512
# About 960 tokens of the tiny models' vocabulary (5 bytes a token): well past the window, within a
# slot of the families' config (4096 tokens over 2 slots).
LONG = " ".join(f"item {i} weighs {i * 7 % 13} units" for i in range(200))


@pytest.fixture(scope="module")
def windowed(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """gemma3-dense.gguf with ``gemma3.attention.sliding_window`` 512, written in place by the
    helper that scripts/tiny-models raises the context with (nothing else of the file moves)."""
    path = tmp_path_factory.mktemp("windowed") / f"gemma3-window{WINDOW}.gguf"
    shutil.copyfile(model_file(tiny_models, "gemma3-dense"), path)
    helper = TESTS.parent / "tools" / "gguf_set_int.py"
    subprocess.run(
        [sys.executable, str(helper), "attention.sliding_window", str(WINDOW), str(path)],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return path


async def health(url: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return dict((await client.get("/health")).json())


async def test_without_swa_full_a_window_of_512_is_judged_none_by_a_probe_past_it(
    short_dir: Path,
    store_dir: Path,  # noqa: F811
    windowed: Path,
    route_lines: RouteLines,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, windowed, store_dir, model={"swa_full": False})) as running:
            model = running.daemon.models.default
            assert "--swa-full" not in model.parts.launcher.argv()
            await ask(running.url, LONG)
            said = await health(running.url)
            assert jobs(running.daemon) == 0
            stats = model.statistics()
    assert model.parts.capability.restores is Restores.NONE, model.parts.capability.why
    unusable = said["restores_unusable"]
    assert isinstance(unusable, dict)
    assert unusable[model.name].startswith("none: ")
    assert (stats.restores, stats.swa_full) == ("none", False)
    [line] = route_lines.lines
    assert (line["route"], line["fallback"]) == ("plain", "restore-unusable"), line
    assert kept_files(store_dir) == []


async def test_under_swa_full_auto_the_file_and_plain_routes_spare_a_prompt_past_the_window(
    short_dir: Path,
    store_dir: Path,  # noqa: F811
    windowed: Path,
    route_lines: RouteLines,
) -> None:
    """Asked twice with a provider (the file route), then after a restart without one (the plain
    route, restored from the prefix store)."""
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config(short_dir, windowed, store_dir), providers_ready=True) as running:
            model = running.daemon.models.default
            assert "--swa-full" in model.parts.launcher.argv()
            await ask(running.url, LONG)
            await ask(running.url, LONG)
            stats = model.statistics()
            await wait_until(lambda: model.store_statistics().stores >= 1)
        async with run_daemon(config(short_dir, windowed, store_dir, with_provider=False)) as running:
            await ask(running.url, LONG)
    assert model.parts.capability.restores is Restores.WHOLE, model.parts.capability.why
    assert (stats.restores, stats.swa_full) == ("whole", True)
    asked, asked_again, restarted = route_lines.lines
    for line in (asked, asked_again):
        assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok"), line
        assert line["prompt_tokens"] > WINDOW + 100, line
        assert line["decoder_prompt_n"] <= 2, line
    assert (restarted["route"], restarted["fallback"]) == ("plain", "stored"), restarted
    # Kept after the reply where the next turn still matches: a raw prompt less its last token.
    assert restarted["restored_tokens"] == asked["prompt_tokens"] - 1, restarted
    assert restarted["decoder_prompt_n"] <= 2, restarted


async def test_under_swa_full_auto_the_share_route_refuses_the_swa_memory_and_the_file_route_spares_the_prompt(
    short_dir: Path,
    store_dir: Path,  # noqa: F811
    windowed: Path,
    route_lines: RouteLines,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(share_config(short_dir, windowed, store_dir)) as running:
            worker = running.daemon.models.default.parts.providers.all[0]
            await child_of(worker).wait_state(ChildState.READY)
            await ask(running.url, LONG)
            await ask(running.url, "Another conversation altogether. " + LONG)
            refused = (await health(running.url)).get("share_refused", {})
            model = running.daemon.models.default
    assert model.parts.capability.restores is Restores.WHOLE, model.parts.capability.why
    assert isinstance(refused, dict)
    assert refused[model.name].endswith("(memory kv+swa)"), refused
    first, second = route_lines.lines
    for line, fallback in ((first, "share-refused"), (second, "share-refused-earlier")):
        assert (line["route"], line["fallback"], line["memory"]) == ("file", fallback, "kv+swa"), line
        assert line["prompt_tokens"] > WINDOW + 100, line
        assert line["decoder_prompt_n"] <= 2, line
