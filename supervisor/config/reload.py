"""What a reload applies: which keys a running daemon takes (each field's ``live`` metadata) and
``reload(old, new)``, pure; and ``source``, how a long-lived component reads its live settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
from attrs import frozen

from .convert import converter, structure, unstructure
from .schema import Config, ModelConfig, model_name

T = TypeVar("T")


# Where a long-lived component reads its settings: once per request (or idle period), from the
# daemon's one frozen Config that a reload swaps whole.  A bare value is a source that never changes.
def source(value: T | Callable[[], T]) -> Callable[[], T]:
    """``value``'s source: itself when it is one (a callable), else one that always gives it."""
    if callable(value):
        return value
    return lambda: value


def live_keys(cls: type = Config, prefix: str = "") -> tuple[str, ...]:
    """The keys (``server.api_keys``) whose fields are marked live, in declaration order."""
    keys: list[str] = []
    attrs.resolve_types(cls)  # the annotations are strings (``from __future__ import annotations``)
    for a in attrs.fields(cls):
        if a.metadata.get("live"):
            keys.append(prefix + a.name)
        elif isinstance(a.type, type) and attrs.has(a.type):
            keys += live_keys(a.type, f"{prefix}{a.name}.")
    return tuple(keys)


@frozen
class Reload:
    config: Config  # the running config with the live keys' new values
    applied: tuple[str, ...]  # changed keys it takes
    restart_needed: tuple[str, ...]  # changed keys it does not take


def reload(old: Config, new: Config, source: str = "<reload>") -> Reload:
    """What a reload from ``old`` to ``new`` applies, and what needs a restart.  Pure.

    [[model]] tables are compared by name: a model added or removed is applied
    (``model[NAME]``: the daemon loads or unloads it, the others untouched), a changed key of a
    kept one is applied where it is live (``model[NAME].ttl_s``), else needs a restart."""
    old_doc, new_doc = unstructure(old), unstructure(new)
    tables = isinstance(old_doc["model"], list), isinstance(new_doc["model"], list)
    model_applied: list[str] = []
    model_restart: list[str] = []
    merged_tables: list[Any] | None = None
    if any(tables):
        old_models, new_models = old_doc.pop("model"), new_doc.pop("model")
        if tables != (True, True):
            model_restart.append("model")  # a change of form moves every model's runtime files
            merged_tables = old_models
        else:
            merged_tables, model_applied, model_restart = _reload_tables(old_models, new_models)
    old_flat, new_flat = _flatten(old_doc), _flatten(new_doc)
    changed = sorted(k for k in old_flat.keys() | new_flat.keys() if old_flat.get(k) != new_flat.get(k))
    live = set(live_keys())
    applied = [k for k in changed if k in live]
    merged = unstructure(old)
    for key in applied:
        _set(merged, key, new_flat[key])
    if merged_tables is not None:
        merged["model"] = merged_tables
    restart = [k for k in changed if k not in live]
    return Reload(structure(merged, source), tuple(model_applied + applied), tuple(model_restart + restart))


def _reload_tables(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> tuple[list[Any], list[str], list[str]]:
    """The [[model]] tables a reload leaves running, the keys it applied and those it did not."""
    live = {a.name for a in attrs.fields(ModelConfig) if a.metadata.get("live")}
    named_old = {model_name(converter.structure(table, ModelConfig)): table for table in old}
    applied: list[str] = []
    restart: list[str] = []
    merged: list[Any] = []
    for table in new:
        name = model_name(converter.structure(table, ModelConfig))
        before = named_old.pop(name, None)
        if before is None:
            applied.append(f"model[{name}]")
            merged.append(table)
            continue
        kept = dict(before)
        for key in sorted(before.keys() | table.keys()):
            if before.get(key) == table.get(key):
                continue
            if key in live:
                applied.append(f"model[{name}].{key}")
                kept[key] = table[key]
            else:
                restart.append(f"model[{name}].{key}")
        merged.append(kept)
    applied += [f"model[{name}]" for name in named_old]  # removed
    return merged, applied, restart


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        data = data[key]
    data[last] = value
