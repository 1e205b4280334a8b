"""The share switch reaches the decoder only when the share route is on, and never a provider."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.daemon import Daemon
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.llama_server import KV_SHARE_ENV, LlamaServerLauncher
from tests.rigs.rig import make_config


def launcher(tmp_path: Path, *, kv_share: bool) -> LlamaServerLauncher:
    config = make_config(tmp_path, model={"path": str(tmp_path / "m.gguf")}, decoder={"binary": "/bin/true"})
    return LlamaServerLauncher(
        "decoder",
        config,
        binary="/bin/true",
        client=DecoderClient(tmp_path / "d.sock"),
        slot_save_path=tmp_path / "state",
        threads=0,
        extra_args=(),
        kv_share=kv_share,
    )


def test_a_sharing_decoder_gets_the_switch_and_the_rest_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONEBIT_TEST_MARK", "kept")
    env = launcher(tmp_path, kv_share=True).env
    assert env is not None
    assert env[KV_SHARE_ENV] == "1"
    assert env["ONEBIT_TEST_MARK"] == "kept"


def test_any_other_llama_server_runs_without_the_switch_even_when_onebitd_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KV_SHARE_ENV, raising=False)
    assert launcher(tmp_path, kv_share=False).env is None  # inherited unchanged
    monkeypatch.setenv(KV_SHARE_ENV, "1")
    env = launcher(tmp_path, kv_share=False).env
    assert env is not None
    assert KV_SHARE_ENV not in env


@pytest.mark.parametrize(
    ("mode", "kv_share_env", "providers", "switched"),
    [
        ("share", None, True, True),
        ("file", "1", True, True),
        ("share", "0", True, False),
        ("file", None, True, False),
        ("share", None, False, False),
    ],
)
def test_the_daemon_switches_its_decoder_only_when_the_share_route_can_run(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    kv_share_env: str | None,
    providers: bool,
    switched: bool,
) -> None:
    if kv_share_env is None:
        monkeypatch.delenv("ONEBIT_KV_SHARE", raising=False)
    else:
        monkeypatch.setenv("ONEBIT_KV_SHARE", kv_share_env)
    provider = [{"kind": "exec", "name": "p", "command": ["/bin/true"]}] if providers else []
    config = make_config(
        tmp_path,
        model={"path": str(tmp_path / "m.gguf")},
        decoder={"binary": "/bin/true"},
        hybrid={"enabled": True, "mode": mode},
        provider=provider,
    )
    assert Daemon(config).models.default.parts.launcher.kv_share is switched
