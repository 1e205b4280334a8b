"""The OpenVINO engine's config keys, device choice and KV layout: pure, no binary needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomli_w

from supervisor import config as configuration
from supervisor.config import LlamaServerProviderConfig
from supervisor.errors import ConfigError
from supervisor.llama import openvino
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.llama_server import LlamaServerLauncher, StateFingerprint

SOURCE = "site.toml"

LISTED = """\
load_backend: loaded OpenVINO backend from /opt/ov/libggml-openvino.so
Available devices:
  OPENVINO0: GGML_OPENVINO_DEVICE=CPU (selected) - AMD EPYC 9B14 (128000 MiB, 120000 MiB free)
  OPENVINO1: GGML_OPENVINO_DEVICE=GPU.0 - Intel(R) Arc(TM) Graphics (iGPU) (16000 MiB, 16000 MiB free)
  OPENVINO2: GGML_OPENVINO_DEVICE=NPU - Intel(R) AI Boost (NPU 4000) (0 MiB, 0 MiB free)
"""


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Any]:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return {"model": {"path": str(model)}, "decoder": {"binary": str(binary)}}


def problems(site: dict[str, Any], *providers: dict[str, Any]) -> list[str]:
    try:
        configuration.loads(tomli_w.dumps({**site, "provider": list(providers)}), SOURCE)
    except ConfigError as exc:
        return exc.lines
    return []


def ov(site: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return {"kind": "llama-server", "name": "ov", "engine": "openvino", "binary": site["decoder"]["binary"], **keys}


def test_the_runtimes_device_list_is_read_from_list_devices_in_its_order() -> None:
    assert openvino.parse_devices(LISTED.splitlines()) == ["CPU", "GPU.0", "NPU"]
    assert openvino.parse_devices(["Available devices:", "  CPU: AMD EPYC (1 MiB, 1 MiB free)"]) == []


@pytest.mark.parametrize(
    ("requested", "available", "chosen"),
    [
        ("auto", ["CPU", "GPU.0", "NPU"], "NPU"),
        ("", ["CPU", "GPU.0"], "GPU.0"),
        ("auto", ["CPU", "GPU"], "GPU"),
        ("auto", ["CPU"], "CPU"),
        ("CPU", ["CPU", "NPU"], "CPU"),
        ("NPU", ["CPU"], None),
        ("GPU", ["CPU", "GPU.0", "GPU.1"], None),
    ],
)
def test_auto_takes_the_npu_first_and_a_named_device_must_be_listed(
    requested: str, available: list[str], chosen: str | None
) -> None:
    assert openvino.choose_device(requested, available) == chosen


def test_an_openvino_provider_takes_an_engine_and_a_device(site: dict[str, Any]) -> None:
    config = configuration.loads(tomli_w.dumps({**site, "provider": [ov(site, device="NPU")]}), SOURCE)
    (provider,) = config.provider
    assert isinstance(provider, LlamaServerProviderConfig)
    assert (provider.engine, provider.device, provider.static_shapes) == ("openvino", "NPU", False)


def test_the_engine_defaults_to_ggml_and_an_unknown_engine_or_device_is_named(site: dict[str, Any]) -> None:
    config = configuration.loads(tomli_w.dumps({**site, "provider": [{"kind": "llama-server", "name": "p"}]}), SOURCE)
    assert config.provider[0].engine == "ggml"  # type: ignore[union-attr]
    assert sorted(problems(site, ov(site, engine="cuda", device="TPU"))) == [
        'site.toml: provider[0].device: expected one of auto, NPU, GPU, GPU.<n>, CPU, got "TPU"',
        'site.toml: provider[0].engine: expected one of ggml, openvino, auto, got "cuda"',
    ]


def test_a_device_or_static_shapes_without_the_openvino_engine_is_an_error(site: dict[str, Any]) -> None:
    only = 'only an engine = "openvino" provider has one; this one\'s engine is "ggml"'
    assert problems(site, {"kind": "llama-server", "name": "p", "device": "NPU", "static_shapes": True}) == [
        f"site.toml: provider[0].device: {only}",
        f"site.toml: provider[0].static_shapes: {only}",
    ]


def test_an_openvino_provider_without_a_binary_names_the_variable(
    site: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(openvino.BINARY_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # and no build in the cache
    assert problems(site, ov(site, binary="")) == [
        "site.toml: provider[0].binary: empty, and no OpenVINO llama-server was found"
        f" (run scripts/setup, or set {openvino.BINARY_ENV})"
    ]
    monkeypatch.setenv(openvino.BINARY_ENV, site["decoder"]["binary"])
    assert problems(site, ov(site, binary="")) == []


def test_the_static_path_is_an_npus_or_forced_by_the_config_or_the_environment() -> None:
    assert openvino.is_static("NPU", False, {})
    assert not openvino.is_static("CPU", False, {})
    assert openvino.is_static("CPU", True, {})
    assert openvino.is_static("GPU.0", False, {openvino.FORCE_STATIC_ENV: "1"})
    assert not openvino.is_static("GPU.0", False, {openvino.FORCE_STATIC_ENV: "0"})


def test_engine_auto_is_openvino_where_its_binary_is_found_else_ggml(
    site: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(openvino.BINARY_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # and no build in the cache
    assert openvino.engine_of("auto", "") == "ggml"
    monkeypatch.setenv(openvino.BINARY_ENV, site["decoder"]["binary"])
    assert openvino.engine_of("auto", "") == "openvino"
    assert openvino.engine_of("ggml", "") == "ggml"
    assert problems(site, {"kind": "llama-server", "name": "p", "engine": "auto", "device": "NPU"}) == []
    assert problems(site, {"kind": "llama-server", "name": "p", "engine": "auto", "binary": "/x"}) == [
        'site.toml: provider[0].binary: engine "auto" looks for its own (an OpenVINO build, else the ggml one);'
        " name the engine with the binary"
    ]


def test_a_provider_runs_with_its_device_and_its_compile_cache_in_the_cache_directory(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    env = openvino.environment("NPU", static_shapes=False, cache=tmp_path / "openvino", binary=binary)
    assert env == {
        "GGML_OPENVINO_DEVICE": "NPU",
        "GGML_OPENVINO_COMPILED_MODEL_CACHE_DIR": str(tmp_path / "openvino" / "compiled"),
        "GGML_OPENVINO_CACHE_DIR": str(tmp_path / "openvino" / "plugin"),
    }
    forced = openvino.environment("CPU", static_shapes=True, cache=tmp_path, binary=tmp_path / "llama-server")
    assert forced["GGML_OPENVINO_FORCE_STATIC"] == "1"


def test_the_compile_cache_follows_the_cache_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/onebit")
    assert openvino.compile_dir("") == Path("/var/cache/onebit/openvino")
    monkeypatch.delenv("CACHE_DIRECTORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert openvino.compile_dir("") == tmp_path / "onebit" / "openvino"
    assert openvino.compile_dir("/srv/ov") == Path("/srv/ov")


def test_a_unified_launcher_adds_the_layout_flags_and_a_static_one_serves_one_slot(
    site: dict[str, Any], tmp_path: Path
) -> None:
    config = configuration.loads(tomli_w.dumps({**site, "model": {**site["model"], "parallel": 4}}), SOURCE)
    launcher = LlamaServerLauncher(
        "provider-ov",
        config,
        binary=site["decoder"]["binary"],
        client=DecoderClient(tmp_path / "p.sock", max_connections=4),
        slot_save_path=tmp_path,
        threads=1,
        extra_args=(),
        kv_unified=True,
    )
    argv = list(launcher.argv())
    assert argv[argv.index("-np") + 1] == "4"
    assert "--kv-unified" in argv
    assert "--no-cache-idle-slots" in argv
    launcher.parallel = 1
    launcher.engine_env = {"GGML_OPENVINO_DEVICE": "NPU"}
    argv = list(launcher.argv())
    assert argv[argv.index("-np") + 1] == "1"
    assert launcher.env is not None
    assert launcher.env["GGML_OPENVINO_DEVICE"] == "NPU"


def test_the_state_fingerprint_names_engines_and_layout_only_where_they_differ_from_ggml(
    site: dict[str, Any],
) -> None:
    config = configuration.loads(tomli_w.dumps(site), SOURCE)
    before = StateFingerprint.of(config, "version: 1").as_json()
    assert "engines" not in before
    assert "kv_unified" not in before
    assert StateFingerprint.of(config, "version: 1", engines=["p=ggml/CPU"]).as_json() == before
    after = StateFingerprint.of(
        config, "version: 1", kv_unified=True, engines=["p=ggml/CPU", "ov=openvino/NPU/static"]
    ).as_json()
    assert after["engines"] == ["p=ggml/CPU", "ov=openvino/NPU/static"]
    assert after["kv_unified"] is True
    assert {k: v for k, v in after.items() if k not in ("engines", "kv_unified")} == before
