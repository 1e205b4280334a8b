"""The build script and the binary lookup agree on where the one patched build of llama.cpp lives, and
what its key says: the patches and the CPU variant(s) it compiled."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from supervisor.config import locate
from supervisor.llama import openvino

ROOT = Path(__file__).resolve().parents[3]


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
    assert Path(printed) == locate.cached_llama_server()
    assert locate.llama_server_build_key() in printed


def test_the_openvino_backend_lives_beside_the_binary_where_ggml_does_not_look_by_itself(tmp_path: Path) -> None:
    binary = tmp_path / "bin" / "llama-server"
    backend = locate.openvino_backend(binary)
    assert backend.parent.parent == binary.parent
    assert backend.parent.name == f"openvino-{locate.openvino_version()}"
    assert openvino.backend_env(binary) == {}  # not built: a provider asks nothing of ggml
    backend.parent.mkdir(parents=True)
    backend.write_bytes(b"")
    assert openvino.backend_env(binary) == {"GGML_BACKEND_PATH": str(backend)}


def test_an_openvino_provider_finds_the_build_only_with_its_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ONEBIT_LLAMA_SERVER_OPENVINO", raising=False)
    binary = locate.cached_llama_server()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert locate.llama_server("", "openvino") is None
    backend = locate.openvino_backend(binary)
    backend.parent.mkdir()
    backend.write_bytes(b"")
    assert locate.llama_server("", "openvino") == binary


@pytest.mark.parametrize(
    "patch", ["LLAMA_SERVER_PATCH", "CPU_PATCH", "AGENT_PATCH", "TOOLS_PATCH", "OPENVINO_PATCH", "TEST_ARCHS_PATCH"]
)
def test_a_changed_patch_changes_the_build_key(patch: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = locate.llama_server_build_key()
    changed = tmp_path / "changed.patch"
    changed.write_bytes(getattr(locate, patch).read_bytes() + b"\n")
    monkeypatch.setattr(locate, patch, changed)
    after = locate.llama_server_build_key()
    assert after != before
    assert after.startswith(f"{locate.LLAMA_CPP_VERSION}-")


def test_a_changed_openvino_pin_keeps_the_build_and_moves_only_its_backend(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key, backend = locate.llama_server_build_key(), locate.openvino_backend(Path("/b/llama-server"))
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("openvino==2099.1.0\n")
    monkeypatch.setattr(locate, "CONSTRAINTS", constraints)
    assert locate.llama_server_build_key() == key
    moved = locate.openvino_backend(Path("/b/llama-server"))
    assert moved == Path("/b/openvino-2099.1.0/libggml-openvino.so")
    assert moved != backend


@pytest.mark.parametrize(
    ("flags", "variant"),
    [
        ("fpu sse4_2 avx avx2 fma f16c bmi2", "haswell"),  # x86-64-v3 (an AMD EPYC of Zen 3 too)
        ("sse4_2 avx avx2 fma f16c bmi2 avx_vnni", "alderlake"),
        ("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw", "skylakex"),
        ("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512_vnni", "cascadelake"),
        (
            "sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni"
            " avx512_bf16",
            "zen4",
        ),
        (
            "sse4_2 avx avx2 fma f16c bmi2 avx512f avx512cd avx512vl avx512dq avx512bw avx512vbmi avx512_vnni"
            " avx512_bf16 amx_tile amx_int8 avx_vnni",
            "sapphirerapids",
        ),
        ("sse4_2 avx", "x64"),  # no AVX2: the floor
        # AVX-512 the OS leaves off: Linux drops its flags (and keeps avx512_vnni's lone name): AVX2 it is.
        ("sse4_2 avx avx2 fma f16c bmi2 avx512_vnni avx512_bf16", "haswell"),
    ],
)
def test_the_cpu_variant_is_the_best_this_processor_has(
    flags: str, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(locate.CPU_VARIANTS_ENV, raising=False)
    assert locate.cpu_tag("x86_64", frozenset(flags.split())) == variant
    assert locate.cpu_variants(variant) == variant


def test_the_portable_build_compiles_the_eight_variants_and_says_so_in_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    local = locate.llama_server_build_key()
    monkeypatch.setenv(locate.CPU_VARIANTS_ENV, "portable")
    assert locate.cpu_tag() == "portable"
    assert locate.llama_server_build_key().endswith("-portable")
    assert locate.llama_server_build_key() != local
    assert locate.cpu_variants("portable").split(";") == [name for name, _ in locate.X86_VARIANTS]
    with pytest.raises(ValueError, match="ONEBIT_CPU_VARIANTS='pentium'"):
        locate.cpu_variants("pentium")


def test_the_build_script_refuses_an_unknown_variant_naming_the_variable(tmp_path: Path) -> None:
    done = subprocess.run(
        [ROOT / "scripts" / "build-llama-server"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path), "ONEBIT_CPU_VARIANTS": "pentium"},
    )
    assert done.returncode != 0
    assert "ONEBIT_CPU_VARIANTS='pentium'" in done.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was made


def test_the_cpu_flags_come_from_proc_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert locate.cpu_flags(cpuinfo) == {"fpu", "avx2", "fma"}
    assert locate.cpu_flags(tmp_path / "none") == frozenset()


def test_a_machine_other_than_x86_builds_ggml_s_native_backend_and_refuses_x86_variants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(locate.CPU_VARIANTS_ENV, raising=False)
    assert locate.cpu_tag("aarch64", frozenset()) == "native"
    assert locate.cpu_variants("native", "aarch64") == ""
    with pytest.raises(ValueError, match="names x86 variants; on this processor the build is native"):
        locate.cpu_variants("portable", "aarch64")


def test_a_portable_build_is_the_one_in_use_where_this_processor_s_own_is_not_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An image built with ONEBIT_CPU_VARIANTS=portable and run without it finds its build."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(locate.CPU_VARIANTS_ENV, raising=False)
    own = locate.cached_llama_server()
    monkeypatch.setenv(locate.CPU_VARIANTS_ENV, "portable")
    portable = locate.cached_llama_server()
    monkeypatch.delenv(locate.CPU_VARIANTS_ENV)
    assert own != portable
    portable.parent.mkdir(parents=True)
    portable.write_text("#!/bin/sh\n")
    assert locate.cached_llama_server() == portable
    assert locate.llama_server_build_key().endswith("-portable")
    own.parent.mkdir(parents=True)
    own.write_text("#!/bin/sh\n")
    assert locate.cached_llama_server() == own  # this processor's own, once it is built


def test_the_build_recipe_is_part_of_the_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    before = locate.llama_server_build_key()
    changed = tmp_path / "build-llama-server"
    changed.write_bytes(locate.BUILD_SCRIPT.read_bytes() + b"# another recipe\n")
    monkeypatch.setattr(locate, "BUILD_SCRIPT", changed)
    assert locate.llama_server_build_key() != before


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
