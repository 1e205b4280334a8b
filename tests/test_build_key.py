"""The build script and the binary lookup agree on where the patched llama-server lives."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor import locate

ROOT = Path(__file__).resolve().parent.parent


def test_locate_looks_where_the_build_script_builds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    printed = subprocess.run(
        [ROOT / "scripts" / "build-llama-server", "--print-path"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()
    assert Path(printed) == locate.cached_llama_server()
    assert locate.llama_server_build_key() in printed


def test_a_changed_patch_changes_the_build_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = locate.llama_server_build_key()
    patch = tmp_path / "changed.patch"
    patch.write_bytes(locate.LLAMA_SERVER_PATCH.read_bytes() + b"\n")
    monkeypatch.setattr(locate, "LLAMA_SERVER_PATCH", patch)
    after = locate.llama_server_build_key()
    assert after != before
    assert after.startswith(f"{locate.LLAMA_CPP_VERSION}-")
