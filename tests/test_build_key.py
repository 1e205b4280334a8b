"""The build script and the binary lookup agree on where each engine's patched llama-server lives."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor.config import locate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("engine", locate.ENGINES)
def test_locate_looks_where_the_build_script_builds(
    engine: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    printed = subprocess.run(
        [ROOT / "scripts" / "build-llama-server", "--engine", engine, "--print-path"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert Path(printed) == locate.cached_llama_server(engine)
    assert locate.llama_server_build_key(engine) in printed


def test_the_default_engine_is_ggml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    printed = subprocess.run(
        [ROOT / "scripts" / "build-llama-server", "--print-path"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert Path(printed) == locate.cached_llama_server() == locate.cached_llama_server("ggml")


def test_the_two_engines_build_apart() -> None:
    assert locate.cached_llama_server("ggml") != locate.cached_llama_server("openvino")
    assert locate.llama_server_build_key("openvino").endswith(f"-openvino{locate.openvino_version()}")


@pytest.mark.parametrize(
    ("engine", "patch"),
    [
        ("ggml", "LLAMA_SERVER_PATCH"),
        ("ggml", "CPU_PATCH"),
        ("ggml", "AGENT_PATCH"),
        ("openvino", "LLAMA_SERVER_PATCH"),
        ("openvino", "OPENVINO_PATCH"),
    ],
)
def test_a_changed_patch_changes_the_build_key(
    engine: str, patch: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    before = locate.llama_server_build_key(engine)
    changed = tmp_path / "changed.patch"
    changed.write_bytes(getattr(locate, patch).read_bytes() + b"\n")
    monkeypatch.setattr(locate, patch, changed)
    after = locate.llama_server_build_key(engine)
    assert after != before
    assert after.startswith(f"{locate.LLAMA_CPP_VERSION}-")


def test_the_agent_patch_is_the_decoder_build_s_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The OpenVINO provider only prefills through /completion: its build (and key) stay without it."""
    assert locate.AGENT_PATCH in locate.engine_patches("ggml")
    assert locate.AGENT_PATCH not in locate.engine_patches("openvino")
    openvino = locate.llama_server_build_key("openvino")
    changed = tmp_path / "changed.patch"
    changed.write_bytes(locate.AGENT_PATCH.read_bytes() + b"\n")
    monkeypatch.setattr(locate, "AGENT_PATCH", changed)
    assert locate.llama_server_build_key("openvino") == openvino


def test_a_changed_openvino_pin_changes_only_the_openvino_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ggml, openvino = locate.llama_server_build_key("ggml"), locate.llama_server_build_key("openvino")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("openvino==2099.1.0\n")
    monkeypatch.setattr(locate, "CONSTRAINTS", constraints)
    assert locate.llama_server_build_key("ggml") == ggml
    assert locate.llama_server_build_key("openvino") != openvino
    assert locate.llama_server_build_key("openvino").endswith("-openvino2099.1.0")


def test_each_engine_has_its_own_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("ONEBIT_LLAMA_SERVER", "/opt/ggml/llama-server")
    monkeypatch.setenv("ONEBIT_LLAMA_SERVER_OPENVINO", "/opt/ov/llama-server")
    assert locate.llama_server("") == Path("/opt/ggml/llama-server")
    assert locate.llama_server("", "ggml") == Path("/opt/ggml/llama-server")
    assert locate.llama_server("", "openvino") == Path("/opt/ov/llama-server")
    assert locate.llama_server("/my/llama-server", "openvino") == Path("/my/llama-server")


def test_no_openvino_build_is_no_binary_not_a_ggml_one_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ONEBIT_LLAMA_SERVER_OPENVINO", raising=False)
    fake = tmp_path / "path" / "llama-server"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    monkeypatch.delenv("ONEBIT_LLAMA_SERVER", raising=False)
    assert locate.llama_server("", "openvino") is None
    assert locate.llama_server("", "ggml") == fake
