"""The level each line of llama.cpp's output is logged at (supervisor/supervise/llama_log.py): its
own, from the letter llama.cpp marked it with, and the level onebitd relays it at under
``log.children``."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from supervisor.supervise import llama_log
from supervisor.supervise.llama_log import level_of, relayed_level

# llama-server's warnings that cannot hold for a child of onebitd's, each as the real llama-server
# writes it at every start, and why.
FILTERED = {
    # onebitd's children listen on unix sockets in a 0700 directory, behind onebitd's key and CORS
    # checks: llama-server's warning to its own operator is not onebitd's operator's.
    "no-api-key-on-a-unix-socket": "0.00.247.567 W srv  llama_server: security: no API key is set and CORS allows"
    " all origins (see https://github.com/ggml-org/llama.cpp/pull/25655)",
}


@pytest.fixture
def children_at() -> Iterator[None]:
    """Each test sets log.children as it needs; the default is back afterwards."""
    try:
        yield
    finally:
        llama_log.set_children_level("warning")


@pytest.mark.parametrize(
    ("line", "level"),
    [
        pytest.param("0.00.247.567 E srv  load_model: failed to load model", logging.ERROR, id="error"),
        pytest.param("0.00.247.567 W srv  init: the slot context (8192) exceeds ...", logging.WARNING, id="warning"),
        pytest.param("0.00.247.567 I srv  main: server is listening", logging.INFO, id="info"),
        pytest.param("0.00.247.567 D srv  main: a debug line", logging.DEBUG, id="debug"),
        pytest.param("1.14.070.548 I slot print_timing: id  0 | task 4497 | ...", logging.DEBUG, id="per-request"),
        pytest.param("1.14.070.548 E slot launch_slot_: failed", logging.ERROR, id="per-request-error"),
        pytest.param("not a llama.cpp line", logging.INFO, id="foreign"),
        *(pytest.param(line, logging.DEBUG, id=name) for name, line in FILTERED.items()),
    ],
)
def test_a_line_has_the_level_it_deserves_for_onebitds_operator(line: str, level: int) -> None:
    assert level_of(line) == level


def test_every_filtered_warning_is_named_here() -> None:
    assert sorted(llama_log.NOT_OURS) == sorted(
        next(words for words in llama_log.NOT_OURS if words in line) for line in FILTERED.values()
    )


@pytest.mark.usefixtures("children_at")
@pytest.mark.parametrize("children", ["debug", "info", "warning", "error"])
def test_a_warning_that_cannot_hold_for_a_child_is_never_more_than_debug(children: str) -> None:
    llama_log.set_children_level(children)
    for line in FILTERED.values():
        assert relayed_level(line) == logging.DEBUG, line


def test_a_similar_security_warning_that_can_hold_is_kept() -> None:
    line = "0.00.247.567 W srv  llama_server: security: MCP proxy (experimental) enabled - do not expose to untrusted"
    assert relayed_level(line) == logging.WARNING


INFO = "0.00.247.567 I srv  main: server is listening"
WARNING = "0.00.247.567 W srv  init: the slot context (8192) exceeds ..."
DEBUG = "0.00.247.567 D srv  main: a debug line"


@pytest.mark.usefixtures("children_at")
@pytest.mark.parametrize(
    ("children", "levels"),
    [
        # The default: the children's warnings and errors, none of their info lines.
        ("warning", (logging.DEBUG, logging.DEBUG, logging.WARNING, logging.DEBUG)),
        ("info", (logging.INFO, logging.INFO, logging.WARNING, logging.DEBUG)),
        ("debug", (logging.INFO, logging.INFO, logging.WARNING, logging.DEBUG)),
        ("error", (logging.DEBUG, logging.DEBUG, logging.DEBUG, logging.DEBUG)),
    ],
)
def test_log_children_relays_lines_from_its_level_up_and_the_rest_at_debug(
    children: str, levels: tuple[int, ...]
) -> None:
    llama_log.set_children_level(children)
    assert tuple(relayed_level(line) for line in (INFO, "not a llama.cpp line", WARNING, DEBUG)) == levels
    assert relayed_level("0.00.247.567 E srv  load_model: failed") == logging.ERROR


def test_by_default_a_childs_info_lines_are_debug() -> None:
    assert relayed_level(INFO) == logging.DEBUG
