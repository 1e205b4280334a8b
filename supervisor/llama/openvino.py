"""The OpenVINO engine of a llama-server provider: its binary, its devices, its environment and flags.

llama.cpp's OpenVINO backend (ggml/src/ggml-openvino) is steered by environment variables only:
``GGML_OPENVINO_DEVICE`` names the device (an unavailable one aborts the process, listing the
available ones), ``GGML_OPENVINO_COMPILED_MODEL_CACHE_DIR`` keeps compiled dynamic (CPU, GPU) graphs
across starts, ``GGML_OPENVINO_CACHE_DIR`` is OpenVINO's own plugin cache (on an NPU its
``NPUW_CACHE_DIR``), and ``GGML_OPENVINO_FORCE_STATIC=1`` takes the static-shape path an NPU runs on
any device.

Which devices there are is asked of the provider's own binary: ``llama-server --list-devices`` loads
the very OpenVINO runtime and plugins the provider will run with, and prints one line per device with
the value to set (``OPENVINO0: GGML_OPENVINO_DEVICE=CPU (selected) - <name>``).  onebitd does not
depend on the ``openvino`` Python wheel (the binary carries its runtime), and asking the binary
answers for the drivers of this machine, not those of whatever wheel Python would import.

The static path serves one sequence (``-np 1``) and writes slot files with one KV stream: a decoder
whose ``-np`` is above 1 keeps one stream per slot and refuses them (``n_stream mismatch``), one
started with ``--kv-unified`` accepts them.  The daemon therefore asks every OpenVINO provider's
runtime for its devices before the decoder starts, and starts every llama-server child with
:data:`UNIFIED_ARGS` when one provider takes the static path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..config import locate
from ..errors import ChildError
from ..supervise.process import output_of

# Names an OpenVINO llama-server instead of scripts/setup's cached build (supervisor/config/locate.py).
BINARY_ENV = locate.ENGINE_ENV["openvino"]
DEVICE_ENV = "GGML_OPENVINO_DEVICE"
FORCE_STATIC_ENV = "GGML_OPENVINO_FORCE_STATIC"
COMPILED_CACHE_ENV = "GGML_OPENVINO_COMPILED_MODEL_CACHE_DIR"
PLUGIN_CACHE_ENV = "GGML_OPENVINO_CACHE_DIR"
# ggml loads one backend from outside the binary's directory by this variable: onebit's build keeps
# the OpenVINO backend there (locate.openvino_backend), so that the decoder never loads it.
BACKEND_PATH_ENV = "GGML_BACKEND_PATH"

# "auto": the first of these kinds the runtime lists.  An NPU is what the provider is for; a GPU
# (integrated or discrete) next; the CPU, which the decoder shares, last.
AUTO_ORDER = ("NPU", "GPU", "CPU")
# What the flags below add to every llama-server child once one provider takes the static path:
# one KV stream for all slots (the static files restore), and idle slots left as they are (with a
# unified cache llama-server otherwise clears every idle slot when a task starts, and onebitd's
# memory of what each slot holds would be wrong).
UNIFIED_ARGS = ("--kv-unified", "--no-cache-idle-slots")

# --list-devices: "  OPENVINO0: GGML_OPENVINO_DEVICE=CPU (selected) - Intel(R) Xeon(R) ... (... MiB free)"
_DEVICE_LINE = re.compile(r"GGML_OPENVINO_DEVICE=(\S+)")
# Loading the runtime and probing its plugins (an NPU driver's first open included) takes a second
# or two; a minute is a runtime that hangs.
LIST_TIMEOUT_S = 60.0


def llama_server(binary: str) -> Path | None:
    """The configured OpenVINO binary, else $ONEBIT_LLAMA_SERVER_OPENVINO, else scripts/setup's build."""
    return locate.llama_server(binary, "openvino")


def compile_dir(configured: str) -> Path:
    """The compile cache: ``cache.compile_dir``, else systemd's ``CacheDirectory=``, else XDG's."""
    if configured:
        return Path(configured).expanduser()
    systemd = os.environ.get("CACHE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]) / "openvino"
    return locate.cache_dir() / "openvino"


def parse_devices(lines: Sequence[str]) -> list[str]:
    """The device names ``--list-devices`` offers, in its order."""
    found: list[str] = []
    for line in lines:
        match = _DEVICE_LINE.search(line)
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


def choose_device(requested: str, available: Sequence[str]) -> str | None:
    """``requested`` ("" or "auto": the first of AUTO_ORDER's kinds) among ``available``; None: not there."""
    if requested not in ("", "auto"):
        return requested if requested in available else None
    for kind in AUTO_ORDER:
        for name in available:
            if name == kind or name.startswith(kind + "."):
                return name
    return available[0] if available else None


def forced_static(environ: Mapping[str, str]) -> bool:
    """onebitd's own environment forces the static path on every OpenVINO child (they inherit it)."""
    return environ.get(FORCE_STATIC_ENV, "").strip() not in ("", "0")


def is_static(device: str, static_shapes: bool, environ: Mapping[str, str]) -> bool:
    """The backend takes its static path on an NPU, and wherever it is forced."""
    return device.startswith("NPU") or static_shapes or forced_static(environ)


def engine_of(engine: str, binary: str) -> str:
    """A provider's engine: "auto" is openvino where an OpenVINO llama-server is found, else ggml."""
    if engine != "auto":
        return engine
    found = llama_server(binary)
    return "openvino" if found is not None and found.is_file() else "ggml"


def backend_env(binary: Path) -> dict[str, str]:
    """What makes ``binary`` load its OpenVINO backend: onebit's build names the backend beside it; a
    binary with the backend compiled in (one named in the config or $ONEBIT_LLAMA_SERVER_OPENVINO)
    needs nothing."""
    backend = locate.openvino_backend(binary.resolve())  # ggml looks beside the real file (/proc/self/exe)
    return {BACKEND_PATH_ENV: str(backend)} if backend.is_file() else {}


def environment(device: str, *, static_shapes: bool, cache: Path, binary: Path) -> dict[str, str]:
    """The variables a provider on ``device`` runs with, on top of onebitd's environment."""
    env = {
        **backend_env(binary),
        DEVICE_ENV: device,
        COMPILED_CACHE_ENV: str(cache / "compiled"),
        PLUGIN_CACHE_ENV: str(cache / "plugin"),
    }
    if static_shapes:
        env[FORCE_STATIC_ENV] = "1"
    return env


async def list_devices(binary: Path, *, timeout_s: float = LIST_TIMEOUT_S) -> list[str]:
    """The devices the binary's OpenVINO runtime offers.  Raises ChildError when it cannot say."""
    # GGML_OPENVINO_DEVICE unset: the backend then picks CPU and lists everything, where a device
    # that is not there would abort the listing.
    env = {key: value for key, value in os.environ.items() if key != DEVICE_ENV} | backend_env(binary)
    argv = [str(binary), "--list-devices"]
    lines, returncode = await output_of("llama-server --list-devices", argv, timeout_s=timeout_s, env=env)
    devices = parse_devices(lines)
    if not devices:
        said = " | ".join(line.strip() for line in lines if line.strip())[-300:]
        raise ChildError(f"{binary} --list-devices ({returncode}) named no OpenVINO device: {said!r}")
    return devices
