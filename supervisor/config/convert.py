"""The one strict cattrs converter of the config, and its errors as ``key.path: what`` lines.

Every problem becomes one line ``<file>: <key.path>: <what is wrong>``: an unknown key, a wrong type
(``"4k"`` is not an int: no silent coercion), a missing field, or an impossible value (a port out of
range, a model file that does not exist, a binary that is not executable).  ``load`` gathers them all
and raises one :class:`~supervisor.errors.ConfigError`.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_unstructure_fn

from ..errors import ConfigError
from .checks import check
from .schema import PROVIDER_KINDS, AutoSwitch, Config, FieldError, Hosts, ModelConfig, ProviderConfig, default_table

T = TypeVar("T")


def _strict(kind: type[T], name: str, accept: tuple[type, ...]) -> Callable[[Any, type], T]:
    def structure(value: Any, _type: type) -> T:
        # bool is an int to Python, never to a config file.
        if isinstance(value, bool) and kind is not bool:
            raise TypeError(f"expected {name}, got {json.dumps(value)}")
        if not isinstance(value, accept):
            raise TypeError(f"expected {name}, got {_show(value)}")
        try:
            result = kind(value)  # type: ignore[call-arg]
        except OverflowError:  # an int too large for a float
            raise ValueError(f"expected {name}, got {value} (too large)") from None
        # TOML has nan; no duration, size or count is one (and trio refuses a nan timeout).
        if isinstance(result, float) and math.isnan(result):
            raise ValueError(f"expected {name}, got nan")
        return result

    return structure


def _show(value: Any) -> str:
    """A value near enough to how the file spells it."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def _structure_table(conv: cattrs.Converter, cls: type) -> Callable[[Any, type], Any]:
    """Structure one table, reporting every problem in it at once.

    cattrs' generated hook runs the attrs validators only once every key is known and every type
    right, and attrs stops at the first failing validator: a file with an unknown key and two values
    out of range would take three rounds to fix.
    """
    fields = attrs.fields(attrs.resolve_types(cls))
    known = {a.name for a in fields}

    def structure_table(value: Any, _type: type) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {_show(value)}")
        errors: list[Exception] = []
        kwargs: dict[str, Any] = {}
        for a in fields:
            if a.name not in value:
                if a.default is attrs.NOTHING:
                    errors.append(_at(KeyError(a.name), cls, a))
                continue
            try:
                item = conv.structure(value[a.name], a.type)
                if a.validator is not None:
                    a.validator(None, a, item)
            except FieldError as exc:
                errors.append(exc)  # it names its field itself
            except Exception as exc:  # what a value provokes in a hook: cattrs collects it the same way
                errors.append(_at(exc, cls, a))
            else:
                kwargs[a.alias] = item
        if extra := value.keys() - known:
            errors.append(ForbiddenExtraKeysError(None, cls, set(extra)))
        if errors:
            raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        return cls(**kwargs)

    return structure_table


def _at(exc: Exception, cls: type, a: attrs.Attribute[Any]) -> Exception:
    """Mark ``exc`` as raised at attribute ``a``, as cattrs does, so :func:`_render` finds the path."""
    note = AttributeValidationNote(f"Structuring class {cls.__qualname__} @ attribute {a.name}", a.name, a.type)
    exc.__notes__ = [*getattr(exc, "__notes__", []), note]
    return exc


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(int, _strict(int, "int", (int,)))
    conv.register_structure_hook(float, _strict(float, "number", (int, float)))
    conv.register_structure_hook(str, _strict(str, "string", (str,)))
    conv.register_structure_hook(bool, _strict(bool, "boolean", (bool,)))

    def structure_tuple(value: Any, type_: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {_show(value)}")
        (item_type, _ellipsis) = type_.__args__
        items: list[Any] = conv.structure(value, list[item_type])  # type: ignore[valid-type]
        return tuple(items)

    conv.register_structure_hook_func(lambda t: getattr(t, "__origin__", None) is tuple, structure_tuple)

    def structure_auto(value: Any, _type: Any) -> Any:
        if value == "auto" or isinstance(value, bool):
            return value
        raise TypeError(f'expected "auto", true or false, got {_show(value)}')

    conv.register_structure_hook_func(lambda t: t == AutoSwitch, structure_auto)

    def structure_hosts(value: Any, _type: Any) -> Hosts:
        if isinstance(value, str):
            value = value.split(",")
        elif not isinstance(value, list | tuple) or not all(isinstance(item, str) for item in value):
            raise TypeError(
                f"expected an address (or several, comma-separated) or a list of addresses, got {_show(value)}"
            )
        return Hosts(tuple(item.strip() for item in value if item.strip()))

    conv.register_structure_hook(Hosts, structure_hosts)
    conv.register_unstructure_hook(Hosts, list)
    conv.register_structure_hook_factory(attrs.has, lambda cls: _structure_table(conv, cls))

    # [[provider]] tables are a tagged union on `kind`.
    by_kind = {kind: cls for cls, kind in PROVIDER_KINDS.items()}

    def structure_provider(value: Any, _type: Any) -> ProviderConfig:
        if not isinstance(value, dict):
            raise TypeError(f"expected a table, got {_show(value)}")
        kind = value.get("kind")
        if kind is None:
            raise _KindError(f"required key missing (one of {', '.join(by_kind)})")
        if kind not in by_kind:
            raise _KindError(f"expected one of {', '.join(by_kind)}, got {_show(kind)}")
        rest = {k: v for k, v in value.items() if k != "kind"}
        provider: ProviderConfig = conv.structure(rest, by_kind[kind])
        return provider

    conv.register_structure_hook(ProviderConfig, structure_provider)
    for cls, kind in PROVIDER_KINDS.items():
        conv.register_unstructure_hook(cls, _tagged(make_dict_unstructure_fn(cls, conv), kind))
    _register_model_forms(conv)
    return conv


def _register_model_forms(conv: cattrs.Converter) -> None:
    """``model`` is a table ([model]: one model) or a list of tables ([[model]]: several).  A list is
    structured table by table (errors at ``model[i].key``) into ``Config.model_tables``, and
    ``Config.model`` is its default one; unstructured, the list is ``model`` again."""
    plain_config = _structure_table(conv, Config)
    model_field = attrs.fields(Config).model

    def structure_config(value: Any, _type: Any) -> Config:
        if not isinstance(value, dict) or not isinstance(value.get("model"), list):
            if isinstance(value, dict) and "model_tables" in value:
                raise ClassValidationError(
                    "While structuring Config", [ForbiddenExtraKeysError(None, Config, {"model_tables"})], Config
                )
            config: Config = plain_config(value, Config)
            return config
        tables = value["model"]
        errors: list[Exception] = []
        structured: list[ModelConfig] = []
        table_errors: list[Exception] = []
        for index, table in enumerate(tables):
            try:
                structured.append(conv.structure(table, ModelConfig))
            except Exception as exc:  # collected and rendered as cattrs' own
                exc.__notes__ = [*getattr(exc, "__notes__", []), IterableValidationNote(f"@ [{index}]", index, dict)]
                table_errors.append(exc)
        if not tables:
            errors.append(_at(ValueError("expected at least one [[model]] table"), Config, model_field))
        if table_errors:
            iterable = IterableValidationError("While structuring [[model]]", table_errors, list)
            errors.append(_at(iterable, Config, model_field))
        rest = {key: item for key, item in value.items() if key not in ("model", "model_tables")}
        try:
            config = plain_config(rest, Config)
        except ClassValidationError as exc:
            errors += list(exc.exceptions)
        if "model_tables" in value:
            errors.append(ForbiddenExtraKeysError(None, Config, {"model_tables"}))
        if errors:
            raise ClassValidationError("While structuring Config", errors, Config)
        chosen = default_table(structured, config.models.default)
        return attrs.evolve(config, model=chosen, model_tables=tuple(structured))

    conv.register_structure_hook(Config, structure_config)
    plain_model = make_dict_unstructure_fn(ModelConfig, conv)
    # TOML has no null: a key left to its default-by-context (providers, preload) is left out.
    conv.register_unstructure_hook(
        ModelConfig, lambda value: {key: item for key, item in plain_model(value).items() if item is not None}
    )
    whole = make_dict_unstructure_fn(Config, conv)

    def unstructure_config(config: Config) -> dict[str, Any]:
        document: dict[str, Any] = whole(config)
        tables = document.pop("model_tables")
        if tables:
            document["model"] = tables
        return document

    conv.register_unstructure_hook(Config, unstructure_config)


def _tagged(plain: Callable[[Any], dict[str, Any]], kind: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {"kind": kind, **plain(value)}


class _KindError(ValueError):
    """A [[provider]] table whose ``kind`` is missing or unknown: reported at ``provider[i].kind``."""


converter = _make_converter()


def _render(exc: BaseException, path: str) -> list[str]:
    """Turn cattrs' nested validation errors into ``key.path: what`` lines."""
    if isinstance(exc, ClassValidationError):
        lines: list[str] = []
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            lines += _render(sub, f"{path}.{note.name}" if path else note.name)
        for sub in without:
            lines += _render(sub, path)
        return lines
    if isinstance(exc, IterableValidationError):
        lines = []
        with_notes_i, without_i = exc.group_exceptions()
        for sub, inote in with_notes_i:
            lines += _render(sub, f"{path}[{inote.index}]")
        for sub in without_i:
            lines += _render(sub, path)
        return lines
    if isinstance(exc, ForbiddenExtraKeysError):
        return [f"{path + '.' if path else ''}{key}: unknown key" for key in sorted(exc.extra_fields)]
    if isinstance(exc, KeyError):
        return [f"{path}: required key missing"]
    if isinstance(exc, FieldError):
        return [f"{path + '.' if path else ''}{exc.field}: {exc}"]
    if isinstance(exc, _KindError):
        return [f"{path}.kind: {exc}"]
    return [f"{path}: {exc}"]


def structure(data: Any, source: str) -> Config:
    """Structure a parsed TOML document into a :class:`Config`, or raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a table at the top level"])
    try:
        return converter.structure(data, Config)
    except (ClassValidationError, IterableValidationError) as exc:
        raise ConfigError([f"{source}: {line}" for line in _render(exc, "")]) from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError([f"{source}: {exc}"]) from None


def loads(text: str, source: str = "<string>") -> Config:
    """Parse and structure TOML text; ``source`` names it in error lines."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: not valid TOML: {exc}"]) from None
    config = structure(data, source)
    check(config, source)
    return config


def load(path: str | os.PathLike[str]) -> Config:
    """Read, parse, structure and check a config file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read: {exc}"]) from None
    return loads(text, str(p))


def unstructure(config: Config) -> dict[str, Any]:
    result: dict[str, Any] = converter.unstructure(config)
    return result
