"""The rig the daemon-level and route tests share: configs for onebitd with the fakes, onebitd run in
this trio run (supervisor/testing.py's ``run_daemon``, which bench/ and chaos/
use too), the fakes' control file, the route lines, and the pieces of a hybrid-route test.

tests/conftest.py turns these into fixtures (``control``, ``route_lines``, ``route_rig``); tests/rigs/helpers.py
has the HTTP and waiting helpers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import struct
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from supervisor import config as configuration
from supervisor import testing
from supervisor.config import Config, locate
from supervisor.errors import ProviderError
from supervisor.llama import openvino
from supervisor.providers import Claim, Job, PrefillJob, Provider, ProviderStatistics
from supervisor.routes.compute import Placement
from supervisor.supervise.child import Child, ChildState

# Re-exported: the tests run onebitd through the rig.
from supervisor.testing import Running as Running
from supervisor.testing import run_daemon as run_daemon
from tests.fakes import fake_control, fake_provider, fake_share_provider
from tests.fakes.llama import core as fake_llama

TESTS = Path(__file__).parents[1]
# The fake llama-server as a program (tests/fakes/llama/process.py), as a launcher's last line of sh.
FAKE_LLAMA_EXEC = (
    f'PYTHONPATH={shlex.quote(str(TESTS.parent))} exec {shlex.quote(sys.executable)} -m tests.fakes.llama.process "$@"'
)
# Each fake's modes, by the names the tests give them (the in-process fake llama-server takes the
# decoder's too).
DecoderModes = fake_llama.Modes
ProviderModes = fake_provider.Modes
ShareModes = fake_share_provider.Modes


def real_llama_server() -> Path:
    """The llama-server scripts/setup built; the suite fails (not skips) without it."""
    found = locate.llama_server("")
    if found is None or not found.is_file():
        pytest.fail("no llama-server: run scripts/setup (it builds one into the cache)")
    return found


def openvino_llama_server() -> Path:
    """The OpenVINO llama-server scripts/setup builds; a test that needs it fails without it, and
    skips only where set-up was told to build none (ONEBIT_NO_OPENVINO)."""
    found = openvino.llama_server("")
    if found is None or not found.is_file():
        if os.environ.get("ONEBIT_NO_OPENVINO"):
            pytest.skip("ONEBIT_NO_OPENVINO is set: scripts/setup built no OpenVINO llama-server")
        pytest.fail(
            f"no OpenVINO llama-server: run scripts/setup (it builds one into the cache), or set {openvino.BINARY_ENV}"
        )
    return found


# The route tests exercise the handoffs themselves, sending the same prompt again and again: the cost
# decision (tests/unit/routes/test_routes.py) would keep a prompt the decoder's slot already holds plain.
HANDOFF_ALWAYS = {"route_by": "length"}


def make_config(runtime_dir: Path, *, text: str = "", **sections: Any) -> Config:
    """A config on port 0 with its runtime directory at ``runtime_dir``; ``sections`` override keys."""
    base = configuration.loads(text, "test.toml") if text else Config()
    data = configuration.unstructure(base)
    data["server"]["port"] = 0
    data["server"]["runtime_dir"] = str(runtime_dir)
    data["server"]["shutdown_grace_s"] = 10.0
    # Each test its own prefix store (never the user's ~/.cache/onebit/prefix).
    data["cache"]["dir"] = str(runtime_dir / "prefix")
    for section, values in sections.items():
        if not isinstance(values, dict):  # a list of tables ([[provider]]) replaces the whole key
            data[section] = values
            continue
        target = data.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key].update(value)
            else:
                target[key] = value
    return configuration.structure(data, "test.toml")


def _gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


# A GGUF header with an architecture and no tensors: what onebitd's own check of a model file (its
# header) accepts, for the fake decoders, which never read it.
FAKE_GGUF = (
    b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string("general.architecture") + struct.pack("<I", 8)
) + _gguf_string("fake")


def _gguf_kv(key: str, kind: int, value: Any) -> bytes:
    name = _gguf_string(key)
    if kind == 8:
        return name + struct.pack("<I", 8) + _gguf_string(str(value))
    if kind == 9:  # an array of int32
        return name + struct.pack("<IIQ", 9, 5, len(value)) + struct.pack(f"<{len(value)}i", *value)
    return name + struct.pack("<I", 4) + struct.pack("<I", value)


def gguf_header(arch: str, pairs: list[tuple[str, int, Any]]) -> bytes:
    """A GGUF header of ``arch`` with no tensors: its ``<arch>.<key>`` values, each ``(key, kind,
    value)``: kind 4 a uint32, 8 a string, 9 an array of int32."""
    items = [("general.architecture", 8, arch), *((f"{arch}.{k}", kind, v) for k, kind, v in pairs)]
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(items)) + b"".join(_gguf_kv(*item) for item in items)


# A Qwen3.5-like hybrid's header: two attention layers beside two gated delta-net ones.
HYBRID_GGUF = gguf_header(
    "qwen35",
    [
        ("block_count", 4, 4),
        ("embedding_length", 4, 256),
        ("attention.head_count", 9, [2, 0, 2, 0]),
        ("attention.head_count_kv", 9, [2, 0, 2, 0]),
        ("ssm.conv_kernel", 4, 4),
        ("ssm.state_size", 4, 16),
        ("ssm.inner_size", 4, 64),
        ("ssm.group_count", 4, 2),
    ],
)


def fake_llama_server(directory: Path) -> Path:
    """A launcher for the fake llama-server as a program (run by this interpreter): ``decoder.binary``."""
    launcher = directory / "fake-llama-server"
    launcher.write_text(f"#!/bin/sh\n{FAKE_LLAMA_EXEC}\n")
    launcher.chmod(0o755)
    return launcher


def fake_decoder_config(runtime_dir: Path, *, model_file: Path | None = None, **sections: Any) -> Config:
    """A config whose decoder is the fake llama-server, run as a program."""
    model = model_file
    if model is None:
        model = runtime_dir / "fake.gguf"
        model.write_bytes(FAKE_GGUF)
    launcher = fake_llama_server(runtime_dir)
    decoder = {"binary": str(launcher), "health": {"interval_s": 0.2, "stop_grace_s": 2.0}}
    decoder.update(sections.pop("decoder", {}))
    model_section = {"path": str(model), "parallel": 2}
    model_section.update(sections.pop("model", {}))
    return make_config(runtime_dir, decoder=decoder, model=model_section, **sections)


def several(
    runtime_dir: Path,
    names: list[str],
    *,
    table: dict[str, Any] | None = None,
    decoder: dict[str, Any] | None = None,
    sections: dict[str, Any] | None = None,
    **models: Any,
) -> Config:
    """A config whose [[model]] tables are ``names``, each the fake decoder on its own fake file
    (``table``: keys every table has too; ``decoder``: keys of the [decoder] table; ``sections``:
    other tables, as ``hybrid`` and ``provider``)."""
    launcher = fake_llama_server(runtime_dir)
    tables = []
    for name in names:
        path = runtime_dir / f"{name}.gguf"
        path.write_bytes(FAKE_GGUF)
        tables.append({"name": name, "path": str(path), "parallel": 2, **(table or {})})
    return make_config(
        runtime_dir,
        decoder={"binary": str(launcher), "health": {"interval_s": 0.2, "stop_grace_s": 2.0}, **(decoder or {})},
        model=tables,
        models=models,
        **(sections or {}),
    )


def env_without(*names: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in names}


# -- steering the fakes, and what they did ---------------------------------------------------------


class Control:
    """The control file every subprocess fake reads its modes from (tests/fakes/fake_control.py), and the
    logs the fakes write beside it.  The ``control`` fixture names it to the fakes through the
    environment, which onebitd's children and the providers a test starts inherit."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "control.json"
        self.pidfile = directory / fake_control.PIDFILE
        self.marker = directory / fake_control.MARKER
        self._sections: dict[str, dict[str, Any]] = {}
        self.set()

    def set(
        self,
        *,
        decoder: DecoderModes | None = None,
        provider: ProviderModes | None = None,
        share: ShareModes | None = None,
    ) -> None:
        """Give each named fake these modes (all of them: a field left out is its default); the fakes
        not named keep theirs.  A running fake reads them again whenever a mode matters."""
        for name, modes in (("decoder", decoder), ("provider", provider), ("share", share)):
            if modes is not None:
                self._sections[name] = dataclasses.asdict(modes)
        fake_control.write(self.path, self._sections)

    def log(self, fake: str) -> Path:
        """Where ``fake`` (``decoder``, ``provider`` or ``share``) logs its events."""
        return self.directory / fake_control.log_name(fake)

    def events(self, fake: str, event: str | None = None) -> list[dict[str, Any]]:
        return fake_control.events(self.log(fake), event)

    def entries(self, event: str = "completion") -> list[dict[str, Any]]:
        """The fake decoder's log lines of ``event``."""
        return self.events("decoder", event)

    async def wait_entries(self, n: int) -> list[dict[str, Any]]:
        """The fake writes a line when a request ends, in its own process: poll its file."""
        while len(found := self.entries()) < n:  # noqa: ASYNC110  # another process: no event to wait on
            await trio.sleep(0.01)
        return found

    def written(self) -> list[str]:
        """The share provider's marker: one line per job that wrote its region or its state file."""
        return self.marker.read_text().splitlines() if self.marker.exists() else []


class RouteLines(testing.RouteLines):
    """supervisor/testing.py's collector, holding each line to what every route line must be."""

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "route_fields", None)
        assert isinstance(fields, dict), f"a route line without its fields: {record.getMessage()}"
        # Both count from the request's arrival: a response ends after its first byte.
        first, total = fields.get("first_byte_ms"), fields.get("total_ms")
        assert first is None or (total is not None and total >= first), record.getMessage()
        super().emit(record)


# -- the hybrid routes end to end: onebitd, the fake decoder and a fake provider ---------------------

# Nine tokens with the fakes' one-word-one-token tokenizer; the rig's min_prompt_tokens is 4.
PROMPT = "the quick brown fox jumps over the lazy dog"
M = len(PROMPT.split())
N_PREDICT = 3
TAIL = "; the backend prefills this request itself"
BODY = {"prompt": PROMPT, "n_predict": N_PREDICT}  # /completion's
# Starting Python a few times on two busy cores; nothing here waits for anything slower.
TIMEOUT = 30
PROVIDERS = {"provider": fake_provider.PATH, "share": fake_share_provider.PATH}


def plain_reply(prompt: str = PROMPT, n: int = N_PREDICT) -> str:
    """What the fake decoder answers on /completion when it prefills the prompt itself."""
    words = prompt.split()
    return " " + " ".join(words[i % len(words)] for i in range(n))


async def complete(client: httpx.AsyncClient, prompt: str = PROMPT, n: int = N_PREDICT) -> str:
    reply = await client.post("/completion", json={"prompt": prompt, "n_predict": n})
    assert reply.status_code == 200, reply.text
    content: str = reply.json()["content"]
    return content


def child_of(provider: Provider) -> Child:
    """The child a llama-server or worker provider supervises."""
    assert provider.child is not None, f"provider {provider.name} supervises no child"
    return provider.child


async def ready(running: Running, kind: str) -> None:
    """A worker takes jobs once its ready line came; an exec provider needs nothing."""
    if kind == "worker":
        await child_of(running.daemon.models.default.parts.providers.all[0]).wait_state(ChildState.READY)


@attrs.define
class RouteRig:
    """onebitd with the hybrid route on, one fake provider (``provider``: tests/fakes/fake_provider.py, or
    ``share``: tests/fakes/fake_share_provider.py) named npu0, and what a test reads after: the fakes' logs,
    onebitd's hybrid log and route lines, and the runtime directory."""

    runtime: Path
    control: Control
    route_lines: RouteLines
    caplog: pytest.LogCaptureFixture
    provider: str = "provider"
    mode: str = "file"  # hybrid.mode

    def config(self, kind: str = "exec", *, health_interval_s: float = 0.2, **hybrid: Any) -> Config:
        """``hybrid`` overrides keys of the [hybrid] section (``mode``, ``prefill_timeout_s``...)."""
        command = [sys.executable, str(PROVIDERS[self.provider]), *(["--worker"] if kind == "worker" else [])]
        return fake_decoder_config(
            self.runtime,
            hybrid={"enabled": True, "mode": self.mode, "min_prompt_tokens": 4, **HANDOFF_ALWAYS, **hybrid},
            # The fakes' state is no model's: nothing for the fidelity check to measure.
            provider=[{"kind": kind, "name": "npu0", "command": command, "fidelity_check": False}],
            decoder={
                "restart": {"backoff_initial_s": 0.01},
                "health": {"interval_s": health_interval_s, "stop_grace_s": 2.0},
            },
        )

    def decoder(self, event: str) -> list[dict[str, Any]]:
        return self.control.entries(event)

    def jobs(self) -> list[dict[str, Any]]:
        return self.control.events(self.provider, "job")

    def cancelled(self) -> list[str]:
        """The ids of the jobs onebitd told the (worker) provider to cancel, in order."""
        return [event["id"] for event in self.control.events(self.provider, "cancel")]

    def provider_pids(self) -> list[int]:
        return [event["pid"] for event in self.control.events(self.provider, "start")]

    def hybrid(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.name == "onebit.hybrid"]

    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.caplog.records if r.name == "onebit.hybrid" and r.levelno >= 30]

    def state_files(self) -> list[str]:
        state = self.runtime / "state"
        return sorted(p.name for p in state.iterdir()) if state.is_dir() else []

    def leftovers(self) -> list[str]:
        """Sockets of a share and state files: nothing of a request may outlive it."""
        return sorted(p.name for p in self.runtime.glob("share-*")) + self.state_files()


# -- an in-process provider -------------------------------------------------------------------------


def own_cores(provider: str) -> Placement:
    """The decoder pinned to core 0 and ``provider`` to core 1: compute apart, so the cost decision's
    margin for near-ties and its sparing of the streams being decoded apply (tests/unit/routes/test_routes.py)."""
    return Placement(decoder_cpus=(0,), provider_cpus={provider: (1,)})


@attrs.define
class ScriptedProvider:
    """A provider that does, in virtual time, what a test tells it to."""

    claim: Claim | None = None  # None: every token, prefill_ms 7.25
    write_file: bool = True
    error: str | None = None
    prefill_s: float = 0.0
    name: str = "scripted"
    kind: str = "scripted"
    supports_share: bool = False
    engine: str | None = None
    device: str | None = None
    admitted: str | None = None
    ready: bool = True
    busy: int = 0
    jobs: list[PrefillJob] = attrs.Factory(list)
    child: Child | None = None

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(self)

    async def wait_settled(self) -> None:
        return

    def cached_tokens(self, tokens: tuple[int, ...]) -> int:
        return 0

    async def prefill(self, job: Job) -> Claim:
        assert isinstance(job, PrefillJob)
        self.jobs.append(job)
        if self.write_file:
            job.state_file.write_text(json.dumps({"fake_state": True, "tokens": list(job.tokens)}))
        await trio.sleep(self.prefill_s)
        if self.error is not None:
            raise ProviderError(self.error)
        return self.claim if self.claim is not None else Claim(len(job.tokens), 7.25)

    def statistics(self) -> ProviderStatistics:
        return ProviderStatistics(self.name, self.kind, True, self.busy, len(self.jobs), 0, None)
