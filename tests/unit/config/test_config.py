"""The config loader: every shipped example loads, and every mistake is one line naming file and key."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
import tomli_w
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor import config as configuration
from supervisor.config import Config, locate, schema
from supervisor.errors import ConfigError
from tests.rigs.rig import FAKE_GGUF

REPO = Path(__file__).parents[3]
EXAMPLES = sorted((REPO / "config").glob("*.toml"))
SOURCE = "site.toml"


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Any]:
    """A document that passes every check on any machine: its model file and binary are in tmp_path."""
    model = tmp_path / "model.gguf"
    model.write_bytes(FAKE_GGUF)
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return {"model": {"path": str(model)}, "decoder": {"binary": str(binary)}}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def problems(text: str) -> list[str]:
    """The lines of the ConfigError that loading ``text`` raises."""
    with pytest.raises(ConfigError) as caught:
        configuration.loads(text, SOURCE)
    assert str(caught.value) == "\n".join(caught.value.lines)
    return caught.value.lines


def problems_with(site: dict[str, Any], **sections: Any) -> list[str]:
    return problems(tomli_w.dumps(merged(site, sections)))


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_every_example_config_loads(path: Path) -> None:
    assert isinstance(configuration.load(path), Config)


def test_the_config_directory_ships_an_example() -> None:
    assert REPO / "config" / "onebit.toml" in EXAMPLES


def test_a_document_that_sets_only_the_paths_gets_every_other_default(site: dict[str, Any]) -> None:
    config = configuration.loads(tomli_w.dumps(site), SOURCE)
    defaults = configuration.unstructure(Config())
    assert configuration.unstructure(config) == merged(defaults, site)


def test_an_unknown_section_names_the_file_and_the_key(site: dict[str, Any]) -> None:
    assert problems_with(site, bogus={"x": 1}) == ["site.toml: bogus: unknown key"]


def test_an_unknown_nested_key_names_its_whole_path(site: dict[str, Any]) -> None:
    lines = problems_with(site, decoder={"health": {"bogus": 1}})
    assert lines == ["site.toml: decoder.health.bogus: unknown key"]


def test_a_string_is_not_coerced_into_an_int(site: dict[str, Any]) -> None:
    assert problems_with(site, model={"ctx_size": "4k"}) == ['site.toml: model.ctx_size: expected int, got "4k"']


def test_a_bool_is_not_an_int(site: dict[str, Any]) -> None:
    assert problems_with(site, model={"parallel": True}) == ["site.toml: model.parallel: expected int, got true"]


def test_a_float_is_not_an_int(site: dict[str, Any]) -> None:
    assert problems_with(site, server={"port": 80.0}) == ["site.toml: server.port: expected int, got 80.0"]


def test_an_int_is_not_a_string(site: dict[str, Any]) -> None:
    assert problems_with(site, server={"runtime_dir": 5}) == ["site.toml: server.runtime_dir: expected string, got 5"]


def test_a_table_is_not_a_list(site: dict[str, Any]) -> None:
    lines = problems_with(site, decoder={"extra_args": {"a": "b"}})
    assert lines == ['site.toml: decoder.extra_args: expected a list, got {"a": "b"}']


def test_a_list_item_of_the_wrong_type_names_its_index(site: dict[str, Any]) -> None:
    lines = problems_with(site, server={"api_keys": ["good", 7]})
    assert lines == ["site.toml: server.api_keys[1]: expected string, got 7"]


@pytest.mark.parametrize("name", ["admin_keys", "api_keys"])
@pytest.mark.parametrize("keys", [[""], ["good", "with space"], ["tab\there"]])
def test_a_key_a_header_cannot_carry_is_refused(site: dict[str, Any], name: str, keys: list[str]) -> None:
    """An empty API key would match a request that bears none."""
    lines = problems_with(site, server={name: keys})
    assert lines == [f"site.toml: server.{name}: expected keys of visible ASCII characters (no space), none empty"]


def test_admin_keys_are_strings(site: dict[str, Any]) -> None:
    assert problems_with(site, server={"admin_keys": "one"}) == [
        'site.toml: server.admin_keys: expected a list, got "one"'
    ]
    assert problems_with(site, server={"admin_keys": [7]}) == [
        "site.toml: server.admin_keys[0]: expected string, got 7"
    ]


def test_a_value_where_a_table_belongs_is_refused() -> None:
    assert problems("decoder = 3\n") == ["site.toml: decoder: expected a table, got 3"]
    assert problems("[decoder]\nhealth = [1]\n") == ["site.toml: decoder.health: expected a table, got [1]"]


def test_a_date_is_shown_as_the_file_spells_it() -> None:
    assert problems("[server]\nruntime_dir = 2024-01-31\n") == [
        "site.toml: server.runtime_dir: expected string, got 2024-01-31"
    ]


@pytest.mark.parametrize("host", ["127.0.0.1,::1", " 127.0.0.1 , ::1 ", ["127.0.0.1", "::1"]])
def test_server_host_takes_a_list_or_a_comma_separated_string_as_llama_server_does(
    site: dict[str, Any], host: str | list[str]
) -> None:
    config = configuration.loads(tomli_w.dumps(merged(site, {"server": {"host": host}})), SOURCE)
    assert config.server.host == ("127.0.0.1", "::1")
    assert configuration.unstructure(config)["server"]["host"] == ["127.0.0.1", "::1"]


@pytest.mark.parametrize(
    ("host", "line"),
    [
        ("127.0.0.1,not a host!", 'server.host: expected an IP address or a host name, got "not a host!"'),
        ("", "server.host: expected at least one address"),
        ([], "server.host: expected at least one address"),
        ([1], "server.host: expected an address (or several, comma-separated) or a list of addresses, got [1]"),
        ("no-such-host.invalid", "server.host: cannot resolve 'no-such-host.invalid': "),
    ],
    ids=["syntax", "empty-string", "empty-list", "not-strings", "unresolvable"],
)
def test_a_bad_server_host_is_a_config_error_naming_the_key(
    site: dict[str, Any], host: str | list[Any], line: str
) -> None:
    [problem] = problems_with(site, server={"host": host})
    assert problem.startswith(f"{SOURCE}: {line}")


def test_cors_origins_takes_star_localhost_and_exact_origins_only(site: dict[str, Any]) -> None:
    good = ["*", "localhost", "https://app.example:8443", "http://[::1]:3000"]
    assert configuration.loads(tomli_w.dumps(merged(site, {"server": {"cors_origins": good}})), SOURCE)
    assert problems_with(site, server={"cors_origins": ["localhost", "app.example", "https://x/path"]}) == [
        f'{SOURCE}: server.cors_origins: expected "*", "localhost" or an origin like '
        f'"https://app.example:8443", got \'app.example\'; expected "*", "localhost" or an origin like '
        f"\"https://app.example:8443\", got 'https://x/path'"
    ]


def test_a_port_out_of_range_names_the_key(site: dict[str, Any]) -> None:
    lines = problems_with(site, server={"port": 70000})
    assert lines == ["site.toml: server.port: must be between 0 and 65535, got 70000"]


def test_a_value_not_among_the_choices_lists_them(site: dict[str, Any]) -> None:
    lines = problems_with(site, log={"level": "loud"})
    assert lines == ['site.toml: log.level: expected one of debug, info, warning, error, got "loud"']


def test_log_children_is_a_level_named_at_its_key_and_warning_by_default(site: dict[str, Any]) -> None:
    lines = problems_with(site, log={"children": "all"})
    assert lines == ['site.toml: log.children: expected one of debug, info, warning, error, got "all"']
    assert Config().log.children == "warning"


def test_nan_is_no_duration(site: dict[str, Any]) -> None:
    lines = problems_with(site, decoder={"health": {"interval_s": float("nan")}})
    assert lines == ["site.toml: decoder.health.interval_s: expected number, got nan"]


def test_an_int_too_large_for_a_float_is_refused() -> None:
    lines = problems(f"[decoder.restart]\nwindow_s = {10**400}\n")
    assert lines == [f"site.toml: decoder.restart.window_s: expected number, got {10**400} (too large)"]


def test_a_model_file_that_does_not_exist_is_named(site: dict[str, Any], tmp_path: Path) -> None:
    missing = tmp_path / "gone.gguf"
    assert problems_with(site, model={"path": str(missing)}) == [f"site.toml: model.path: no such file: {missing}"]


def test_a_path_under_an_unknown_users_home_is_no_such_file(site: dict[str, Any]) -> None:
    lines = problems_with(site, model={"path": "~no-such-user-here/model.gguf"})
    assert lines == ["site.toml: model.path: no such file: ~no-such-user-here/model.gguf"]


def test_a_binary_that_is_not_executable_is_named(site: dict[str, Any], tmp_path: Path) -> None:
    plain = tmp_path / "not-a-program"
    plain.write_text("")
    lines = problems_with(site, decoder={"binary": str(plain)})
    assert lines == [f"site.toml: decoder.binary: not executable: {plain}"]


def test_a_cpu_that_does_not_exist_is_named(site: dict[str, Any]) -> None:
    cpus = os.cpu_count() or 1
    lines = problems_with(site, decoder={"cpu_affinity": [0, cpus]})
    assert lines == [f"site.toml: decoder.cpu_affinity[1]: no such CPU {cpus}"]


def test_invalid_toml_names_the_file_and_the_place() -> None:
    (line,) = problems("[model\npath = 1\n")
    assert line.startswith("site.toml: not valid TOML: ")
    assert "line 1" in line


def test_a_backoff_cap_below_the_initial_backoff_is_refused(site: dict[str, Any]) -> None:
    lines = problems_with(site, decoder={"restart": {"backoff_initial_s": 2.0, "backoff_max_s": 1.0}})
    assert lines == ["site.toml: decoder.restart.backoff_max_s: must be at least backoff_initial_s"]


def test_every_problem_in_a_table_is_reported_at_once(site: dict[str, Any]) -> None:
    # attrs stops at the first failing validator and cattrs runs none while a key is unknown.
    lines = problems_with(
        site,
        server={"port": 70000, "queue_limit": -1, "host": 5, "bogus": True},
        decoder={"health": {"failures": 0, "typo": 1}},
    )
    assert sorted(lines) == [
        "site.toml: decoder.health.failures: must be at least 1, got 0",
        "site.toml: decoder.health.typo: unknown key",
        "site.toml: server.bogus: unknown key",
        "site.toml: server.host: expected an address (or several, comma-separated) or a list of addresses, got 5",
        "site.toml: server.port: must be between 0 and 65535, got 70000",
        "site.toml: server.queue_limit: must be at least 0, got -1",
    ]


def test_the_cache_table_takes_its_keys_and_documents_its_defaults(site: dict[str, Any]) -> None:
    config = configuration.loads(tomli_w.dumps(site), SOURCE)
    assert attrs.asdict(config.cache) == {
        "enabled": True,
        "dir": "",
        "max_bytes": 4 * 1024**3,
        "min_tokens": 256,
        "ram_mib": 1024,
        "compile_dir": "",
        "shared_dir": "",
        "shared_rescan_s": 2.0,
        "shared_max_age_s": 7 * 86400.0,
    }
    cache = {
        "enabled": False,
        "dir": "/srv/prefix",
        "max_bytes": 1000,
        "min_tokens": 64,
        "ram_mib": -1,
        "compile_dir": "/srv/openvino",
        "shared_dir": "/mnt/onebit-store",
        "shared_rescan_s": 0.5,
        "shared_max_age_s": 3600.0,
    }
    config = configuration.loads(tomli_w.dumps(merged(site, {"cache": cache})), SOURCE)
    assert attrs.asdict(config.cache) == cache


def test_impossible_shared_store_values_name_their_key_and_file(site: dict[str, Any]) -> None:
    lines = problems_with(
        site, server={"host_id": "a~b"}, cache={"shared_rescan_s": 0, "shared_max_age_s": 0, "shared_dir": 5}
    )
    assert sorted(lines) == [
        "site.toml: cache.shared_dir: expected string, got 5",
        "site.toml: cache.shared_max_age_s: must be at least 1, got 0.0",
        "site.toml: cache.shared_rescan_s: must be at least 0.05, got 0.0",
        "site.toml: server.host_id: expected up to 64 letters, digits, '.', '-' and '_', got \"a~b\"",
    ]


def test_the_host_id_defaults_to_the_hostname_made_a_host_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "web 1~prod")
    assert (locate.host_id(""), locate.host_id("b")) == ("web-1-prod", "b")
    assert schema.HOST_ID.fullmatch(locate.host_id(""))


def test_impossible_cache_values_are_named(site: dict[str, Any]) -> None:
    lines = problems_with(site, cache={"max_bytes": 0, "min_tokens": 0, "ram_mib": -2, "enabled": "yes", "size": 1})
    assert sorted(lines) == [
        'site.toml: cache.enabled: expected boolean, got "yes"',
        "site.toml: cache.max_bytes: must be at least 1, got 0",
        "site.toml: cache.min_tokens: must be at least 1, got 0",
        "site.toml: cache.ram_mib: must be at least -1, got -2",
        "site.toml: cache.size: unknown key",
    ]


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        configuration.load(missing)
    (line,) = caught.value.lines
    assert line.startswith(f"{missing}: cannot read: ")


# -- fuzz -----------------------------------------------------------------------------------------


# Paths and names the checks look at twice: a home that does not exist, a name too long, a device.
AWKWARD_STRINGS = st.sampled_from(["", "~", "~nobody-at-all/x", "/", "/dev/null", "x" * 300, "a\x00b"])


def _typed(tp: Any) -> st.SearchStrategy[Any]:
    """Values of the right type for a key, in and out of range: they get past the type checks."""
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-2, 70000)
    if tp is float:
        return st.floats() | st.integers(-2, 1000)
    if tp is str:
        return AWKWARD_STRINGS | st.text(max_size=20)
    if typing.get_origin(tp) is tuple:
        return st.lists(_typed(typing.get_args(tp)[0]), max_size=3)
    return st.dictionaries(st.text(max_size=4), st.integers(), max_size=1)  # a table, or a union of them


def _leaves(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every key path of the schema, tables included, with its type."""
    leaves = []
    for attribute in attrs.fields(attrs.resolve_types(cls)):
        path = (*prefix, attribute.name)
        leaves.append((path, attribute.type))
        if isinstance(attribute.type, type) and attrs.has(attribute.type):
            leaves += _leaves(attribute.type, path)
    return leaves


def _nested(edits: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for path, value in edits:
        table = document
        for key in path[:-1]:
            if not isinstance(table.get(key), dict):
                table[key] = {}
            table = table[key]
        table[path[-1]] = value
    return document


LEAVES = _leaves(Config)
KEYS = st.sampled_from(sorted({path[-1] for path, _type in LEAVES})) | st.text(max_size=8)
SCALARS = st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.dates() | st.datetimes() | st.times()
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=12
)
EDIT = st.sampled_from(LEAVES).flatmap(lambda leaf: st.tuples(st.just(leaf[0]), _typed(leaf[1]) | VALUES))
# Arbitrary documents rarely get past "unknown key"; a few edits of real keys, mostly well typed,
# reach the range checks and the file-system checks behind them.
DOCUMENTS = st.dictionaries(KEYS, VALUES, max_size=6) | st.lists(EDIT, min_size=1, max_size=3).map(_nested)


def assert_only_config_errors(text: str) -> None:
    """Loading ``text`` succeeds, or raises ConfigError whose every line names the source."""
    try:
        configuration.loads(text, SOURCE)
    except ConfigError as exc:
        lines = exc.lines
    else:
        return
    assert lines
    assert all(line.startswith(f"{SOURCE}: ") for line in lines), lines


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(DOCUMENTS)
# Found by this fuzz once: pathlib raised RuntimeError (no such user) and OSError (name too long).
@example({"model": {"path": "~nobody-at-all/x"}})
@example({"decoder": {"binary": "x" * 300}})
def test_any_toml_document_loads_or_raises_only_config_error_lines(document: dict[str, Any]) -> None:
    assert_only_config_errors(tomli_w.dumps(document))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_loads_or_raises_only_config_error_lines(text: str) -> None:
    assert_only_config_errors(text)


# -- onebitd --check-config -----------------------------------------------------------------------


async def check_config(path: Path) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "supervisor.daemon", "--check-config", str(path)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )


async def test_check_config_exits_0_on_a_good_file(site: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "good.toml"
    path.write_text(tomli_w.dumps(site))
    with trio.fail_after(30):
        result = await check_config(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == f"{path}: ok\n"


async def test_check_config_exits_non_zero_with_the_lines_on_stderr(site: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(tomli_w.dumps(merged(site, {"model": {"ctx_size": "4k"}, "server": {"port": 70000}})))
    with trio.fail_after(30):
        result = await check_config(path)
    assert result.returncode != 0
    assert result.stdout == b""
    assert sorted(result.stderr.decode().splitlines()) == [
        f'onebitd: {path}: model.ctx_size: expected int, got "4k"',
        f"onebitd: {path}: server.port: must be between 0 and 65535, got 70000",
    ]


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"not a model\n", "not a GGUF file (no GGUF magic)"),
        (FAKE_GGUF[:20], "the header ends early: a truncated file"),
    ],
    ids=["not-gguf", "truncated"],
)
async def test_check_config_names_a_model_file_llama_cpp_cannot_load(
    site: dict[str, Any], tmp_path: Path, data: bytes, said: str
) -> None:
    model = tmp_path / "model.gguf"  # the site's
    model.write_bytes(data)
    path = tmp_path / "bad-model.toml"
    path.write_text(tomli_w.dumps(site))
    with trio.fail_after(30):
        result = await check_config(path)
    assert result.returncode == 2
    assert result.stderr.decode().splitlines() == [f"onebitd: {path}: model.path: {model}: {said}"]


# -- what a reload applies ----------------------------------------------------------------------------


def test_the_operations_guide_lists_exactly_the_keys_marked_live() -> None:
    text = (Path(__file__).parents[3] / "docs" / "operations.md").read_text()
    paragraph = text.split("Keys that change live", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"`([a-z_]+\.[a-z_.]+)`", paragraph)
    assert listed == list(configuration.live_keys())


def test_a_reload_applies_the_live_keys_and_names_the_rest_without_taking_them() -> None:
    old = configuration.Config()
    new = attrs.evolve(
        old,
        server=attrs.evolve(old.server, idle_timeout_s=5.0, port=9000),
        hybrid=attrs.evolve(old.hybrid, route_by="length"),
        model=attrs.evolve(old.model, ctx_size=8192),
    )
    done = configuration.reload(old, new)
    assert done.applied == ("hybrid.route_by", "server.idle_timeout_s")
    assert done.restart_needed == ("model.ctx_size", "server.port")
    assert done.config == attrs.evolve(
        old,
        server=attrs.evolve(old.server, idle_timeout_s=5.0),
        hybrid=attrs.evolve(old.hybrid, route_by="length"),
    )


def test_a_reload_without_changes_applies_nothing() -> None:
    done = configuration.reload(configuration.Config(), configuration.Config())
    assert (done.applied, done.restart_needed) == ((), ())
