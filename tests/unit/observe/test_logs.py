"""Log lines fit the journal: a level on every line, no timestamp of ours under systemd, JSON on request."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from supervisor.observe import logs
from supervisor.observe.logs import ROUTE_LOGGER
from supervisor.routeline import RouteLine
from supervisor.supervise import llama_log


@pytest.fixture
def restore_root_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        llama_log.set_children_level("warning")
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


def emit_route_line() -> None:
    line = RouteLine(req="1-1", endpoint="/completion", status=200, prompt_tokens=3, slot=0)
    logging.getLogger(ROUTE_LOGGER).info(line.logfmt(), extra={"route_fields": line.fields()})


@pytest.mark.usefixtures("restore_root_logging")
def test_under_systemd_a_line_starts_with_its_syslog_priority_and_has_no_timestamp_of_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    out = io.StringIO()
    logs.setup("logfmt", "info", out)
    logging.getLogger("onebit.child").warning("decoder: health check failed (1 of 3)")
    emit_route_line()
    first, second = out.getvalue().splitlines()
    assert first == "<4>warning onebit.child: decoder: health check failed (1 of 3)"
    assert second.startswith("<6>info onebit.route: route=plain req=1-1 endpoint=/completion status=200")


@pytest.mark.usefixtures("restore_root_logging")
def test_outside_systemd_a_line_has_a_timestamp_and_a_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = io.StringIO()
    logs.setup("logfmt", "info", out)
    logging.getLogger("onebit.daemon").info("stopped")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} info onebit\.daemon: stopped\n", out.getvalue())


@pytest.mark.usefixtures("restore_root_logging")
def test_json_logs_put_the_route_lines_fields_at_the_top_level() -> None:
    out = io.StringIO()
    logs.setup("json", "info", out)
    emit_route_line()
    logging.getLogger("onebit.daemon").info("stopped")
    route, plain = (json.loads(line) for line in out.getvalue().splitlines())
    assert route["route"] == "plain"
    assert route["prompt_tokens"] == 3
    assert route["fallback"] is None
    assert route["level"] == "info"
    assert "msg" not in route
    assert (plain["msg"], plain["logger"]) == ("stopped", "onebit.daemon")


@pytest.mark.usefixtures("restore_root_logging")
def test_log_level_debug_shows_onebitds_debug_lines_but_not_trio_websockets() -> None:
    stream = io.StringIO()
    logs.setup("logfmt", "debug", stream)
    logging.getLogger("onebit.child").debug("decoder| a slot line")
    logging.getLogger("trio-websocket").debug("server handshake")
    logging.getLogger("trio-websocket").warning("a real problem")
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == [
        "onebit.child: decoder| a slot line",
        "trio-websocket: a real problem",
    ]


@pytest.mark.usefixtures("restore_root_logging")
@pytest.mark.parametrize(("children", "shown"), [("warning", False), ("info", True)])
def test_log_children_decides_whether_a_childs_info_lines_reach_an_info_log(children: str, shown: bool) -> None:
    stream = io.StringIO()
    logs.setup("logfmt", "info", stream, children=children)
    line = "0.00.247.567 I srv  main: server is listening on unix:///run/onebit/decoder.sock"
    logging.getLogger("onebit.child").log(llama_log.relayed_level(line), "decoder| %s", line)
    assert (line in stream.getvalue()) is shown
