"""scripts/build-llama-server's steps on a fake cmake: one line per step and a progress line from ninja's
``[n/m]`` counts on stderr, the compiler's output in a log file (shown whole when a step fails), each
part installed beside the binary, the binary last, and a binary that loads no CPU backend refused.

The patched source tree is laid out in advance (``src/.onebit-patched``), so nothing is downloaded;
the fake cmake writes what a configure and a build would and prints ninja-shaped lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import locate

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "build-llama-server"
TIMEOUT_S = 60

FAKE_CMAKE = r"""#!/usr/bin/env bash
# A stand-in for cmake: a configure writes CMakeCache.txt, a build prints ninja's [n/m] lines with
# compiler noise between them and writes each target into build/bin.
set -eu
if [ "$1" = "-S" ]; then
    build="$4"
    mkdir -p "$build/bin"
    : >"$build/CMakeCache.txt"
    for arg in "$@"; do
        [ "$arg" != "-DGGML_OPENVINO=ON" ] || echo "GGML_OPENVINO:BOOL=ON" >>"$build/CMakeCache.txt"
    done
    echo "-- configured (fake)"
    exit 0
fi
build="$2"; shift 2
targets=()
while [ $# -gt 0 ]; do case "$1" in --target) shift; targets+=("$@"); break ;; *) shift ;; esac; done
for n in 1 2 3 4 5 6 7 8; do
    echo "[$n/8] Building CXX object step$n.o"
    echo "warning: unused variable 'x' [-Wunused-variable] (noise $n)"
done
if [ -n "${FAKE_CMAKE_FAIL:-}" ]; then echo "error: the compiler broke"; exit 1; fi
for target in "${targets[@]}"; do
    case "$target" in
        llama-server)
            listing="${FAKE_LIST_DEVICES:-echo load_backend: loaded CPU backend from libggml-cpu-x.so}"
            printf '#!/bin/sh\n%s\n' "$listing" >"$build/bin/llama-server"
            chmod 755 "$build/bin/llama-server"
            echo lib >"$build/bin/libllama.so"
            echo lib >"$build/bin/libggml-cpu-haswell.so"
            ;;
        *) printf '#!/bin/sh\n' >"$build/bin/$target"; chmod 755 "$build/bin/$target" ;;
    esac
done
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An XDG cache whose llama.cpp source is already patched, and a fake cmake first on PATH."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(locate.CPU_VARIANTS_ENV, raising=False)
    source = tmp_path / "xdg" / "onebit" / f"llama.cpp-{locate.llama_server_build_key()}" / "src"
    (source / "models" / "templates").mkdir(parents=True)
    (source / "models" / "templates" / "chat.jinja").write_text("{{ messages }}")
    (source / ".onebit-patched").touch()
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "cmake").write_text(FAKE_CMAKE)
    (tools / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    return tmp_path / "xdg" / "onebit"


def build(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args, sys.executable],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )


def test_a_build_says_one_line_a_step_and_its_progress_and_keeps_the_compiler_in_a_log(cache: Path) -> None:
    done = build()
    assert done.returncode == 0, done.stderr
    binary = Path(done.stdout.strip())
    assert binary == locate.cached_llama_server()
    assert binary.is_file()
    assert (binary.parent / "libggml-cpu-haswell.so").is_file()
    assert (binary.parent.parent / "templates" / "chat.jinja").is_file()
    lines = done.stderr.splitlines()
    # Not a terminal: a progress line at each quarter, and no compiler output at all.
    progress = [line.strip() for line in lines if line.startswith("  llama-server:")]
    assert [line.split(",")[0] for line in progress] == [
        "llama-server: 2/8 (25%)",
        "llama-server: 4/8 (50%)",
        "llama-server: 6/8 (75%)",
        "llama-server: 8/8 (100%)",
    ]
    assert not [line for line in lines if "warning" in line or "Building" in line]
    assert len(lines) <= 10, done.stderr
    log = next(line for line in lines if "compiling llama-server (log: " in line).split("(log: ")[1].rstrip(")")
    assert "warning: unused variable 'x' [-Wunused-variable] (noise 3)" in Path(log).read_text()
    assert any("llama-server built: loaded CPU backend from" in line for line in lines)

    again = build()
    assert (again.returncode, again.stdout.strip(), again.stderr) == (0, str(binary), "")


def test_the_tools_are_targets_of_the_same_build_made_only_when_asked(cache: Path) -> None:
    binary = Path(build().stdout.strip())
    assert not (binary.parent / "test-llama-archs").exists()
    done = build("--tools")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == binary
    assert (binary.parent / "test-llama-archs").is_file()
    assert (binary.parent / "llama-quantize").is_file()
    assert "compiling test-llama-archs and llama-quantize" in done.stderr
    assert "configuring" not in done.stderr  # the kept tree: nothing configured again


def test_a_failed_compile_shows_its_log_whole_and_leaves_no_binary(cache: Path) -> None:
    done = build(FAKE_CMAKE_FAIL="1")
    assert done.returncode != 0
    assert "compiling llama-server failed; its log" in done.stderr
    for n in range(1, 9):
        assert f"(noise {n})" in done.stderr
    assert "error: the compiler broke" in done.stderr
    assert not locate.cached_llama_server().exists()


def test_a_binary_that_loads_no_cpu_backend_is_refused_and_the_portable_build_named(cache: Path) -> None:
    done = build(FAKE_LIST_DEVICES="echo no backends")
    assert done.returncode != 0
    assert "loads no CPU backend" in done.stderr
    assert "ONEBIT_CPU_VARIANTS=portable" in done.stderr
    assert not locate.cached_llama_server().exists()
