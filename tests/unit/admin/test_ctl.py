"""onebitctl: the verb registry (its own verbs and onebitd's table), ``config show`` and ``config check``."""

from __future__ import annotations

import inspect
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import trio

from supervisor import config as configuration
from supervisor.admin import ctl
from supervisor.admin import verbs as admin
from supervisor.config import locate

REPO = Path(__file__).parents[3]


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


def test_config_show_prints_toml_that_loads_back_into_the_same_config(
    good_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl.main(["config", "show", "--config", str(good_file)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    assert configuration.structure(shown, "shown") == configuration.load(good_file)


def test_config_show_fills_in_every_default(good_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Written out, not derived from Config(): a default that changes, or one that goes missing from
    # the output, fails here (docs/operations.md and config/onebit.toml describe these values).
    assert ctl.main(["config", "show", "--config", str(good_file)]) == 0
    shown = tomllib.loads(capsys.readouterr().out)
    here = good_file.parent
    assert shown == {
        "server": {
            "host": ["127.0.0.1"],
            "port": 9090,
            "max_body_bytes": 4194304,
            "queue_limit": 64,
            "retry_after_s": 1,
            "api_keys": ["k1"],
            "admin_keys": [],
            "shutdown_grace_s": 30.0,
            "runtime_dir": "",
            "cors_origins": ["localhost"],
            "slots_endpoint": False,
            "body_timeout_s": 30.0,
            "idle_timeout_s": 75.0,
            "write_timeout_s": 60.0,
            "detach_timeout_s": 300.0,
            "host_id": "",
        },
        "model": {
            "path": str(here / "model.gguf"),
            "alias": "",
            "ctx_size": 2048,
            "parallel": 4,
            "batch_size": 2048,
            "ubatch_size": 512,
            "cache_type_k": "f16",
            "cache_type_v": "f16",
            "swa_full": "auto",
            "name": "",
            "aliases": [],
            "threads": -1,
            "extra_args": [],
            "ttl_s": 0.0,
            "pin": False,
        },
        "decoder": {
            "binary": str(here / "llama-server"),
            "threads": 0,
            "cpu_affinity": [],
            "extra_args": ["--verbose"],
            "health": {
                "interval_s": 2.0,
                "timeout_s": 5.0,
                "failures": 5,
                "start_timeout_s": 300.0,
                "stop_grace_s": 10.0,
            },
            "restart": {"backoff_initial_s": 0.5, "backoff_max_s": 30.0, "max_failures": 5, "window_s": 300.0},
        },
        "hybrid": {
            "enabled": False,
            "mode": "file",
            "min_prompt_tokens": 256,
            "prefill_timeout_s": 120.0,
            "restore_check_tokens": 2,
            "prefer_margin": 0.15,
            "route_by": "cost",
            "max_stall_ms": 500.0,
            "decoder_ms_per_token": 5.0,
            "provider_ms_per_token": 5.0,
            "handoff_ms_per_mib": 1.0,
        },
        "provider": [
            {
                "kind": "exec",
                "name": "prefill",
                "command": [sys.executable, "prefill.py"],
                "cpu_affinity": [],
                "kill_grace_s": 0.0,
                "fidelity_check": True,
            }
        ],
        "cache": {
            "enabled": True,
            "dir": "",
            "max_bytes": 4294967296,
            "min_tokens": 256,
            "ram_mib": 1024,
            "compile_dir": "",
            "shared_dir": "",
            "shared_rescan_s": 2.0,
            "shared_max_age_s": 604800.0,
        },
        "log": {"format": "logfmt", "level": "info", "children": "warning"},
        "models": {"default": "", "max_loaded": 0, "memory_budget_mib": 0, "load_timeout_s": 120.0},
    }


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
    monkeypatch.delenv("ONEBIT_CONFIG", raising=False)
    monkeypatch.setattr(locate, "DEFAULT_CONFIG", str(tmp_path / "absent.toml"))
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


def test_onebitctl_has_exactly_onebitds_verbs_besides_its_own_and_a_presentation_for_each() -> None:
    assert set(ctl.VERBS) - set(admin.VERBS) == {"config show", "config check"}
    assert set(admin.VERBS) <= set(ctl.VERBS)
    assert set(ctl.SHOWN) == set(admin.VERBS)


@pytest.mark.parametrize("name", list(admin.VERBS))
def test_every_verb_of_onebitds_table_reaches_onebitd_with_its_arguments_from_the_command_line(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sent: list[tuple[Path, str, dict[str, Any] | None]] = []

    async def call(path: Path, verb: str, args: dict[str, Any] | None = None, on_event: Any = None) -> dict[str, Any]:
        sent.append((path, verb, args))
        return {"ok": False, "error": "refused by the test", "lines": ["why"]}

    monkeypatch.setattr(admin, "call", call)
    arguments = admin.VERBS[name].arguments
    options = [
        option
        for argument in arguments
        # A value every argument's type takes: seconds, a number of lines, a name.
        for option in (("3",) if argument.positional else (f"--{argument.name}", "3"))
    ]
    assert ctl.main(["--socket", "/nonexistent/admin.sock", *name.split(), *options]) == 1
    expected = {argument.name: argument.type("3") for argument in arguments}
    assert sent == [(Path("/nonexistent/admin.sock"), name, expected)]
    assert capsys.readouterr().err == "onebitctl: refused by the test\nonebitctl: why\n"


def test_an_argument_left_out_is_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[dict[str, Any] | None] = []

    async def call(path: Path, verb: str, args: dict[str, Any] | None = None, on_event: Any = None) -> dict[str, Any]:
        sent.append(args)
        return {"ok": True, "result": {"drained": True}}

    monkeypatch.setattr(admin, "call", call)
    assert ctl.main(["--socket", "/nonexistent/admin.sock", "drain"]) == 0
    assert sent == [{}]


def test_a_table_verb_onebitctl_does_not_present_prints_its_result_as_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def echo(_daemon: admin.Managed, args: dict[str, Any], _send: admin.Send) -> Any:
        """``{"verb": "echo", "args": {"times": N}}`` -> its arguments."""
        return args

    async def call(path: Path, verb: str, args: dict[str, Any] | None = None, on_event: Any = None) -> dict[str, Any]:
        return {"ok": True, "result": {"verb": verb, "args": args}}

    entry = admin.Verb(echo, (admin.Argument("times", int, "N", "how many times"),))
    monkeypatch.setattr(admin, "call", call)
    monkeypatch.setitem(ctl.VERBS, "echo", ctl.daemon_verb("echo", entry))
    assert ctl.main(["--socket", "/nonexistent/admin.sock", "echo", "--times", "3"]) == 0
    assert capsys.readouterr().out == '{"args": {"times": 3}, "verb": "echo"}\n'
    with pytest.raises(SystemExit):
        ctl.main(["echo", "--help"])
    shown = capsys.readouterr().out
    assert re.search(r"^  --times N +how many times$", shown, re.M)
    assert '``{"verb": "echo", "args": {"times": N}}`` -> its arguments.' in shown


def test_onebitctl_cannot_declare_a_verb_of_onebitds_table_nor_present_one_that_is_not_there() -> None:
    def shown(_args: Any, _result: Any = None) -> int:
        """Documented."""
        return 0

    with pytest.raises(TypeError, match="onebitd's verb"):
        ctl.verb("status")(shown)
    with pytest.raises(TypeError, match="not one of onebitd's verbs"):
        ctl.shows("explode")(shown)
    assert "explode" not in ctl.SHOWN


async def test_onebitctl_runs_as_a_program(good_file: Path, bad_file: Path) -> None:
    command = [sys.executable, "-m", "supervisor.admin.ctl", "config", "check"]
    with trio.fail_after(30):
        good = await trio.run_process([*command, str(good_file)], capture_stdout=True, check=False, cwd=REPO)
        bad = await trio.run_process([*command, str(bad_file)], capture_stderr=True, check=False, cwd=REPO)
    assert (good.returncode, good.stdout) == (0, f"{good_file}: ok\n".encode())
    assert bad.returncode == 2
    assert f"onebitctl: {bad_file}: model.ctx_size: " in bad.stderr.decode()
