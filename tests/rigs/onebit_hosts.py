"""onebitd hosts as real processes, for the tests with a load balancer in front.

Each host is ``onebitd --config FILE`` (the console script of this virtual environment) with its
own runtime directory and its own real llama-server, on its own loopback address (127.0.0.2,
127.0.0.3, ...) and one port shared by all of them, as hosts behind a balancer usually are.
A host can be stopped (SIGTERM: onebitd drains, stops its decoder and exits) and started again,
and is always reaped, whatever happens to the test.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import tomli_w
import trio

from supervisor import config as configuration
from tests.rigs.rig import make_config, real_llama_server

BIN = Path(sys.executable).parent
# Two real decoders share the machine's cores with everything else: one thread and two small slots
# each (1024 tokens: the longest chat the tests send is about 300).
MODEL = {"parallel": 2, "ctx_size": 2048}
DECODER = {"threads": 1, "health": {"interval_s": 0.2}}
# SIGTERM drains (nothing is in flight by then in these tests) and stops the decoder, whose own
# stop grace is 10 s (decoder.health.stop_grace_s); past this onebitd is killed.
STOP_GRACE_S = 30.0


class PortTaken(Exception):
    """Another process took the port between our probe and onebitd's bind: pick another one."""


def free_port(addresses: Sequence[str]) -> int:
    """A port that is free on every one of ``addresses`` right now (port 0 on the first, then the
    same number on the others).  Someone may still take it before our servers bind it: callers
    start over on :class:`PortTaken`."""
    while True:
        probes: list[socket.socket] = []
        try:
            first = socket.socket()
            probes.append(first)
            first.bind((addresses[0], 0))
            port: int = first.getsockname()[1]
            for address in addresses[1:]:
                probe = socket.socket()
                probes.append(probe)
                probe.bind((address, port))
            return port
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        finally:
            for probe in probes:
                probe.close()


async def stop_process(process: trio.Process, signum: int, grace_s: float, *, group: bool = False) -> None:
    """Send ``signum``, wait up to ``grace_s``, then SIGKILL; always reaped.  Shielded: this runs on
    the way out of a cancelled or failed test too.  ``group``: the process leads its own process
    group, and the whole group is signalled (nginx's workers would outlive a killed master)."""

    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        except ProcessLookupError:
            pass

    with trio.CancelScope(shield=True):
        if process.returncode is None:
            send(signum)
            with trio.move_on_after(grace_s):
                await process.wait()
        if process.returncode is None or group:
            send(signal.SIGKILL)  # the group: whatever is left of it, if anything
        await process.wait()


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-n:])


class Host:
    """One onebitd host: ``name`` is its name in the balancer's config."""

    def __init__(
        self,
        name: str,
        address: str,
        port: int,
        directory: Path,
        cache: dict[str, Any] | None = None,
        *,
        tables: dict[str, dict[str, Any]] | None = None,
        onebitd: Path = BIN / "onebitd",
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``cache``: keys of its [cache] table (``shared_dir``: a prefix store the hosts share);
        ``tables``: keys of any table, over the host's own (``decoder.binary``, ``model.path``);
        ``onebitd``: the console script it runs (another environment's), from ``cwd``, with ``env``
        (else this process's environment)."""
        self.name = name
        self.cache = cache or {}
        self.tables = tables or {}
        self.onebitd = onebitd
        self.cwd = cwd
        self.env = env
        self.address = address
        self.port = port
        self.directory = directory
        self.runtime_dir = directory / "run"
        self.config_path = directory / "onebit.toml"
        self.log = directory / "onebitd.log"
        self.process: trio.Process | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def endpoint(self) -> str:
        """``address:port``, as a balancer's config names it."""
        return f"{self.address}:{self.port}"

    @property
    def admin_socket(self) -> Path:
        return self.runtime_dir / "admin.sock"

    def write_config(self) -> None:
        sections: dict[str, Any] = {
            # One machine: each host its own server.host_id (else all would be this one's hostname).
            "server": {"host": self.address, "port": self.port, "shutdown_grace_s": 20.0, "host_id": self.name},
            "model": MODEL,
            "decoder": DECODER,
        }
        if self.cache:
            sections["cache"] = self.cache
        for table, keys in self.tables.items():
            sections[table] = {**sections.get(table, {}), **keys}
        config = make_config(self.runtime_dir, **sections)
        data: dict[str, Any] = configuration.unstructure(config)
        self.config_path.write_text(tomli_w.dumps(data))

    async def start(self) -> None:
        """Start onebitd and return once its /health says 200 (decoder loaded, front bound)."""
        assert self.process is None, f"{self.name} is already running"
        self.starts += 1
        with self.log.open("a") as log:
            log.write(f"--- start {self.starts}\n")
            log.flush()
            self.process = await trio.lowlevel.open_process(
                [str(self.onebitd), "--config", str(self.config_path)],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        await self.wait_healthy()

    async def wait_healthy(self) -> None:
        process = self.process
        assert process is not None
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as client:
            # Polled: the state of another process, announced by no event we could wait on.
            while True:
                if process.returncode is not None:
                    await process.wait()
                    self.process = None
                    tail = log_tail(self.log)
                    if "Address already in use" in tail or "[Errno 98]" in tail:
                        raise PortTaken(f"{self.name}: port {self.port} was taken")
                    raise AssertionError(f"{self.name}: onebitd exited with {process.returncode}:\n{tail}")
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not bound yet
                await trio.sleep(0.05)

    async def stop(self) -> int:
        """SIGTERM (a drain, then the decoder's stop) and reap; the exit status."""
        process, self.process = self.process, None
        assert process is not None, f"{self.name} is not running"
        await stop_process(process, signal.SIGTERM, STOP_GRACE_S)
        assert process.returncode is not None
        return process.returncode

    async def restart(self) -> int:
        status = await self.stop()
        await self.start()
        return status

    async def ctl(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        """``onebitctl --socket <admin socket> ARGS``, run to its end."""
        argv = [str(BIN / "onebitctl"), "--socket", str(self.admin_socket), *args]
        return await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)


@asynccontextmanager
async def open_hosts(
    directory: Path, n: int = 2, cache: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[list[Host]]:
    """``n`` hosts on 127.0.0.2, 127.0.0.3, ... sharing one port, all healthy; stopped on the way out
    (``cache``: keys of every host's [cache] table; ``options``: :class:`Host`'s keyword arguments)."""
    real_llama_server()
    addresses = [f"127.0.0.{2 + i}" for i in range(n)]
    for _attempt in range(3):
        port = free_port(addresses)
        hosts = [
            Host(f"onebit{i + 1}", address, port, directory / f"host{i + 1}", cache, **options)
            for i, address in enumerate(addresses)
        ]
        for host in hosts:
            host.directory.mkdir(exist_ok=True)
            host.write_config()
        taken = False
        try:
            try:
                async with trio.open_nursery() as nursery:
                    for host in hosts:
                        nursery.start_soon(host.start)
            except* PortTaken:
                taken = True
            if not taken:
                yield hosts
                return
        finally:
            for host in hosts:
                if host.process is not None:
                    await host.stop()
    raise AssertionError(f"could not find a port free on all of {addresses} in 3 tries")
