"""HAProxy and nginx, run in the foreground from the example configs in config/, and reaped.

HAProxy reads ``config/haproxy.cfg`` itself: addresses, the check interval and its stats socket come
from the environment, and its listening socket is one we bound and pass down (``fd@N``), so no
port can be taken from under it.  nginx reads no environment: ``config/nginx.conf`` is copied with
exactly its three example addresses replaced, next to a copy of the njs module it imports
(``config/onebit_affinity.js``).  Both examples name two hosts; for more, the copy gets one more
server line per host, written like the second one.
"""

from __future__ import annotations

import csv
import errno
import io
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.rigs.onebit_hosts import Host, PortTaken, free_port, log_tail, stop_process

CONFIG = Path(__file__).parents[2] / "config"
HAPROXY_CONFIG = CONFIG / "haproxy.cfg"
NGINX_CONFIG = CONFIG / "nginx.conf"
NGINX_MODULE = CONFIG / "onebit_affinity.js"  # the affinity key, js_import'ed by nginx.conf
BACKEND = "onebit"  # the backend (HAProxy) and upstream (nginx) name in the example configs
# Fast checks, so that a test waits a fraction of a second for HAProxy to see a drain
# (the example's default is 2 s; "fall 2" and "rise 2" stay as shipped).
CHECK_INTER = "100ms"
# nginx's example addresses, replaced by the test's own (nginx has no environment variables).
NGINX_EXAMPLE_HOSTS = ("server 10.0.0.11:8080 ", "server 10.0.0.12:8080 ")
NGINX_EXAMPLE_LISTEN = "listen 8080;"
# HAProxy's second server line, after which a third host (and more) goes.
HAPROXY_LAST_SERVER = 'server onebit2 "${ONEBIT_HOST2-10.0.0.12:8080}"'
STOP_GRACE_S = 10.0


def make_directory(path: Path, mode: int = 0o700) -> None:
    path.mkdir(exist_ok=True)
    path.chmod(mode)


def nginx_argv(program: str, directory: Path, config: Path) -> list[str]:
    """In the foreground, its error log on stderr, its pid file with us (not /run/nginx.pid)."""
    pid = f"daemon off; pid {directory / 'nginx.pid'};"
    return [program, "-p", str(directory), "-c", str(config), "-e", "stderr", "-g", pid]


def require(program: str) -> str:
    """The program's path; the test fails (not skips) without it."""
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if found is None:
        pytest.fail(f"no {program}: run scripts/setup (as root it installs Debian's {program} package)")
    return found


class HAProxy:
    def __init__(self, directory: Path, process: trio.Process, listener: socket.socket) -> None:
        self.directory = directory
        self.process = process
        self.socket = directory / "haproxy.sock"
        self.log = directory / "haproxy.log"
        address, port = listener.getsockname()
        self.url = f"http://{address}:{port}"

    async def command(self, line: str) -> str:
        """One command on the stats socket (HAProxy's CLI), its whole answer."""
        stream = await trio.open_unix_socket(str(self.socket))
        async with stream:
            await stream.send_all(line.encode() + b"\n")
            chunks = []
            while data := await stream.receive_some():
                chunks.append(data)
        return b"".join(chunks).decode()

    async def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` for our backend: one row per server, and one named BACKEND."""
        text = (await self.command("show stat")).lstrip("# ")
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text)) if row["pxname"] == BACKEND}

    async def server_status(self, name: str) -> str:
        return (await self.stats())[name]["status"]

    async def wait_status(self, name: str, status: str) -> None:
        """Until HAProxy says ``status`` (``UP``, ``DOWN``) for server ``name``, not a transition
        (``UP 1/2``, ``DOWN 1/2``) on the way.  Polled: HAProxy's checks announce nothing to us."""
        while (await self.server_status(name)) != status:  # noqa: ASYNC110  # another process
            await trio.sleep(0.05)

    async def wait_ready(self) -> None:
        while True:  # polled: HAProxy creates its stats socket when it has parsed its config
            if self.process.returncode is not None:
                raise AssertionError(f"haproxy exited with {self.process.returncode}:\n{log_tail(self.log)}")
            try:
                await self.stats()
                return
            except OSError:
                await trio.sleep(0.05)


def haproxy_config(directory: Path, hosts: Sequence[Host]) -> Path:
    """config/haproxy.cfg itself for two hosts; for more, a copy with a server line for each
    (``onebit3 "${ONEBIT_HOST3}"``, ...), written as the second."""
    if len(hosts) == 2:
        return HAPROXY_CONFIG
    text = HAPROXY_CONFIG.read_text()
    assert text.count(HAPROXY_LAST_SERVER) == 1, f"{HAPROXY_CONFIG} should name {HAPROXY_LAST_SERVER!r} once"
    more = "".join(f'\n    server {host.name} "${{ONEBIT_HOST{i}}}"' for i, host in enumerate(hosts[2:], start=3))
    path = directory / "haproxy.cfg"
    path.write_text(text.replace(HAPROXY_LAST_SERVER, HAPROXY_LAST_SERVER + more))
    return path


def haproxy_env(hosts: Sequence[Host], bind: str, stats_socket: Path) -> dict[str, str]:
    """The environment config/haproxy.cfg reads: our hosts (named onebit1, onebit2, ...), where to
    listen, fast checks."""
    assert [host.name for host in hosts] == [f"onebit{i}" for i in range(1, len(hosts) + 1)]
    return {
        **os.environ,
        "ONEBIT_LB_BIND": bind,
        **{f"ONEBIT_HOST{i}": host.endpoint for i, host in enumerate(hosts, start=1)},
        "ONEBIT_CHECK_INTER": CHECK_INTER,
        "ONEBIT_LB_SOCKET": str(stats_socket),
    }


@asynccontextmanager
async def open_haproxy(directory: Path, hosts: Sequence[Host]) -> AsyncIterator[HAProxy]:
    """config/haproxy.cfg in front of ``hosts`` (its servers onebit1, onebit2, and more if given),
    listening on 127.0.0.1 on a port of our choosing; stopped and reaped on the way out."""
    program = require("haproxy")
    make_directory(directory)
    config = haproxy_config(directory, hosts)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    fd = listener.fileno()
    env = haproxy_env(hosts, f"fd@{fd}", directory / "haproxy.sock")
    with listener, (directory / "haproxy.log").open("a") as log:
        process = await trio.lowlevel.open_process(
            [program, "-db", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(fd,),
        )
        try:
            haproxy = HAProxy(directory, process, listener)
            await haproxy.wait_ready()
            yield haproxy
        finally:
            await stop_process(process, signal.SIGTERM, STOP_GRACE_S)


class Nginx:
    def __init__(self, directory: Path, process: trio.Process, port: int) -> None:
        self.directory = directory
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.log = directory / "nginx.log"


def nginx_config(hosts: Sequence[Host], port: int) -> str:
    """config/nginx.conf with its example addresses replaced by ours, each exactly once; a host past
    the second gets a server line of its own, written as the second."""
    text = NGINX_CONFIG.read_text()
    first, second = NGINX_EXAMPLE_HOSTS
    replacements = [(first, f"server {hosts[0].endpoint} ")]
    last = text[text.index(second) : text.index("\n", text.index(second))]  # the whole second line
    more = "".join("\n" + last.replace(second, f"server {host.endpoint} ") for host in hosts[2:])
    replacements.append((last, last.replace(second, f"server {hosts[1].endpoint} ") + more))
    replacements.append((NGINX_EXAMPLE_LISTEN, f"listen 127.0.0.1:{port};"))
    for old, new in replacements:
        assert text.count(old) == 1, f"{NGINX_CONFIG} should name {old!r} exactly once"
        text = text.replace(old, new)
    return text


@asynccontextmanager
async def open_nginx(directory: Path, hosts: Sequence[Host]) -> AsyncIterator[Nginx]:
    """config/nginx.conf in front of ``hosts``, on 127.0.0.1; stopped and reaped on the way out."""
    program = require("nginx")
    # Run as root, nginx's workers become "nobody", who must be able to reach the config's directory.
    make_directory(directory, mode=0o755)
    for _attempt in range(3):
        port = free_port(["127.0.0.1"])
        path = directory / "nginx.conf"
        path.write_text(nginx_config(hosts, port))
        shutil.copyfile(NGINX_MODULE, directory / NGINX_MODULE.name)  # js_import finds it next to nginx.conf
        log_path = directory / "nginx.log"
        with log_path.open("a") as log:
            # Its own session: nginx's workers would outlive a master we had to kill, and a
            # process-group kill reaches them all.
            process = await trio.lowlevel.open_process(
                nginx_argv(program, directory, path),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            await wait_listening(process, port, log_path)
        except PortTaken:
            await stop_process(process, signal.SIGTERM, STOP_GRACE_S, group=True)
            continue
        try:
            yield Nginx(directory, process, port)
            return
        finally:
            await stop_process(process, signal.SIGTERM, STOP_GRACE_S, group=True)
    raise AssertionError("could not find a free port for nginx in 3 tries")


async def wait_listening(process: trio.Process, port: int, log: Path) -> None:
    while True:  # polled: nginx binds in its own process and tells us nothing
        if process.returncode is not None:
            tail = log_tail(log)
            if "Address already in use" in tail:
                raise PortTaken(f"nginx: port {port} was taken")
            raise AssertionError(f"nginx exited with {process.returncode}:\n{tail}")
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, None):
                raise
            await trio.sleep(0.05)
        else:
            await stream.aclose()
            return


async def assert_status_surface_refused(client: httpx.AsyncClient, host_url: str) -> None:
    """The balancer (``client``) refuses onebitd's status surface, which the host itself serves to
    the balancer: the proxy reaches it from loopback, which onebitd lets in."""
    async with httpx.AsyncClient(base_url=host_url, timeout=client.timeout) as direct:
        assert (await direct.get("/onebit/status")).status_code == 200
    for path in ("/onebit", "/onebit/", "/onebit/status", "/onebit/events"):
        reply = await client.get(path)
        assert reply.status_code == 403, (path, reply.status_code)
