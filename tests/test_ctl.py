"""onebitctl: the verb registry, ``config show`` and ``config check``."""

from __future__ import annotations

import inspect
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import trio

from supervisor import config as configuration
from supervisor import ctl, daemon

REPO = Path(__file__).parent.parent


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    """A config with a few non-defaults (a provider among them) whose paths exist on any machine."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    document = {
        "server": {"port": 9090, "api_keys": ["k1"]},
        "model": {"path": str(model), "ctx_size": 2048},
        "decoder": {"binary": str(binary), "extra_args": ["--verbose"], "health": {"failures": 5}},
        "provider": [{"kind": "exec", "name": "prefill", "command": [sys.executable, "prefill.py"]}],
    }
    path = tmp_path / "onebit.toml"
    path.write_text(tomli_w.dumps(document))
    return path


@pytest.fixture
def bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nctx_size = "4k"\n\n[decoder.health]\nbogus = 1\n')
    return path


def key_paths(table: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in table.items():
        paths.add(prefix + key)
        if isinstance(value, dict):
            paths |= key_paths(value, f"{prefix}{key}.")
    return paths


def test_config_show_prints_toml_that_loads_back_into_the_same_config(
    good_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl.main(["config", "show", "--config", str(good_file)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert configuration.structure(shown, "shown") == configuration.load(good_file)


def test_config_show_fills_in_every_default(good_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["config", "show", "--config", str(good_file)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert key_paths(shown) == key_paths(configuration.unstructure(configuration.Config()))
    assert shown["decoder"]["health"]["stop_grace_s"] == configuration.HealthPolicy().stop_grace_s
    assert shown["decoder"]["health"]["failures"] == 5


def test_config_show_reads_the_file_named_by_onebit_config(
    good_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ONEBIT_CONFIG", str(good_file))
    assert ctl.main(["config", "show"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# {good_file}, with every default filled in\n")
    assert tomllib.loads(out)["server"]["port"] == 9090


def test_config_show_falls_back_to_the_file_onebitd_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ctl.DEFAULT_CONFIG == daemon.DEFAULT_CONFIG
    monkeypatch.delenv("ONEBIT_CONFIG", raising=False)
    monkeypatch.setattr(ctl, "DEFAULT_CONFIG", str(tmp_path / "absent.toml"))
    assert ctl.main(["config", "show"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"onebitctl: {tmp_path / 'absent.toml'}: cannot read: ")


def test_config_show_of_a_bad_file_names_the_file_and_keys_and_exits_2(
    bad_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl.main(["config", "show", "--config", str(bad_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert sorted(captured.err.splitlines()) == [
        f"onebitctl: {bad_file}: decoder.health.bogus: unknown key",
        f'onebitctl: {bad_file}: model.ctx_size: expected int, got "4k"',
    ]


def test_config_check_says_ok_and_exits_0(good_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["config", "check", str(good_file)]) == 0
    assert capsys.readouterr().out == f"{good_file}: ok\n"


def test_config_check_names_the_file_and_keys_and_exits_2(bad_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["config", "check", str(bad_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 2
    assert all(line.startswith(f"onebitctl: {bad_file}: ") for line in captured.err.splitlines())


def test_config_check_without_a_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ctl.main(["config", "check"])
    assert exit_.value.code == 2
    assert "FILE" in capsys.readouterr().err


def test_no_verb_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ctl.main([])
    assert exit_.value.code == 2
    assert "usage: onebitctl" in capsys.readouterr().err


def test_every_verb_has_a_docstring_and_a_place_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"config show", "config check"} <= set(ctl.VERBS)
    for name, entry in ctl.VERBS.items():
        doc = inspect.getdoc(entry.handler)
        assert doc, name
        with pytest.raises(SystemExit) as exit_:
            ctl.main([*name.split(), "--help"])
        assert exit_.value.code == 0
        assert doc.splitlines()[0] in capsys.readouterr().out


def test_a_verb_without_a_docstring_is_refused() -> None:
    def undocumented(_args: Any) -> int:
        return 0

    with pytest.raises(TypeError, match="docstring"):
        ctl.verb("secret")(undocumented)
    assert "secret" not in ctl.VERBS


async def test_onebitctl_runs_as_a_program(good_file: Path, bad_file: Path) -> None:
    command = [sys.executable, "-m", "supervisor.ctl", "config", "check"]
    with trio.fail_after(30):
        good = await trio.run_process([*command, str(good_file)], capture_stdout=True, check=False, cwd=REPO)
        bad = await trio.run_process([*command, str(bad_file)], capture_stderr=True, check=False, cwd=REPO)
    assert (good.returncode, good.stdout) == (0, f"{good_file}: ok\n".encode())
    assert bad.returncode == 2
    assert f"onebitctl: {bad_file}: model.ctx_size: " in bad.stderr.decode()
