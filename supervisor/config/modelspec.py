"""What each model of a config is: its names, whether it is the default or preloaded, and the one-model
config its decoder runs under.

A config serves one model (the single ``[model]`` table) or several (``[[model]]`` tables).  Each
model's decoder, providers, launcher and prefix store take a :class:`~supervisor.config.Config` as
they did when there was one model: :func:`specs` derives one per model, whose ``model`` is that
model's table, whose ``decoder.threads`` and ``extra_args`` are that model's, and whose
``provider`` list holds that model's providers only.  Pure: nothing here touches a process.

Where each model's files go (:attr:`ModelSpec.subdir`): with the single ``[model]`` table, where
they always went (``<runtime_dir>/decoder.sock``, ``<runtime_dir>/state``, ``cache.dir``); with
``[[model]]`` tables, each model under ``model-<name>`` of both directories.
"""

from __future__ import annotations

import attrs

from . import locate
from .schema import Config, ModelConfig, model_name

# The prefix a model's directory takes under the runtime and cache directories ([[model]] tables):
# never one of the daemon's own names there (state, prefix, admin.sock).
SUBDIR_PREFIX = "model-"


@attrs.frozen
class ModelSpec:
    name: str
    aliases: tuple[str, ...]
    config: Config  # the one-model config this model's decoder and providers run under
    default: bool  # the model of a request that names none
    preload: bool
    # Where its runtime files and prefix store go below the daemon's directories; "": the daemon's own.
    subdir: str

    @property
    def table(self) -> ModelConfig:
        return self.config.model

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def specs(config: Config) -> tuple[ModelSpec, ...]:
    """Every model ``config`` serves, in the file's order (config.check() has vetted the names)."""
    tables = config.model_tables or (config.model,)
    several = bool(config.model_tables)
    named = {name for table in tables for name in table.providers or ()}
    result: list[ModelSpec] = []
    for table in tables:
        name = model_name(table)
        default = table is config.model
        if table.providers is not None:
            wanted = set(table.providers)
        elif default:
            wanted = {provider.name for provider in config.provider} - named  # those no other model took
        else:
            wanted = set()
        decoder = attrs.evolve(
            config.decoder,
            threads=config.decoder.threads if table.threads < 0 else table.threads,
            extra_args=(*config.decoder.extra_args, *table.extra_args),
        )
        subdir = f"{SUBDIR_PREFIX}{name}" if several else ""
        cache = config.cache
        if subdir:
            cache = attrs.evolve(cache, dir=str(locate.prefix_store_dir(cache.dir, port=config.server.port) / subdir))
            shared = locate.shared_store_dir(cache.shared_dir)
            if shared is not None:
                cache = attrs.evolve(cache, shared_dir=str(shared / subdir))
        one = attrs.evolve(
            config,
            # llama-server's --alias: the name /v1/models of this decoder lists.
            model=attrs.evolve(table, alias=table.alias or name) if several else table,
            model_tables=(),
            decoder=decoder,
            provider=tuple(provider for provider in config.provider if provider.name in wanted),
            cache=cache,
        )
        preload = default if table.preload is None else table.preload
        result.append(ModelSpec(name, table.aliases, one, default, preload, subdir))
    return tuple(result)


def table_now(config: Config, spec: ModelSpec) -> ModelConfig:
    """What the running ``config`` says of ``spec``'s model now, found by its name (a reload swaps
    the config whole); the table it started with when the config no longer has it."""
    if not config.model_tables:
        return config.model
    for table in config.model_tables:
        if model_name(table) == spec.name:
            return table
    return spec.table


def shared_providers(config: Config) -> frozenset[str]:
    """The providers that several ``[[model]]`` tables name: each runs for one model at a time
    (supervisor/providers/seat.py).  The default model's implicit share is only those no other
    model took, so it never shares."""
    counts: dict[str, int] = {}
    for table in config.model_tables:
        for name in set(table.providers or ()):
            counts[name] = counts.get(name, 0) + 1
    return frozenset(name for name, count in counts.items() if count > 1)
