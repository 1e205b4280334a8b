"""The level each line of llama.cpp's output is logged at (supervisor/supervise/llama_log.py)."""

from __future__ import annotations

import logging

import pytest

from supervisor.supervise.llama_log import level_of


@pytest.mark.parametrize(
    ("line", "level"),
    [
        pytest.param("0.00.247.567 E srv  load_model: failed to load model", logging.ERROR, id="error"),
        pytest.param("0.00.247.567 W srv  init: the slot context (8192) exceeds ...", logging.WARNING, id="warning"),
        pytest.param("0.00.247.567 I srv  main: server is listening", logging.INFO, id="info"),
        pytest.param("1.14.070.548 I slot print_timing: id  0 | task 4497 | ...", logging.DEBUG, id="per-request"),
        pytest.param("1.14.070.548 E slot launch_slot_: failed", logging.ERROR, id="per-request-error"),
        pytest.param("not a llama.cpp line", logging.INFO, id="foreign"),
        # onebitd's children listen on unix sockets in a 0700 directory, behind onebitd's key and
        # CORS checks: llama-server's warning to its own operator is not onebitd's operator's.
        pytest.param(
            "0.00.247.567 W srv  llama_server: security: no API key is set and CORS allows all origins "
            "(see https://github.com/ggml-org/llama.cpp/pull/25655)",
            logging.INFO,
            id="no-api-key-on-a-unix-socket",
        ),
    ],
)
def test_a_line_is_logged_at_the_level_it_deserves_for_onebitds_operator(line: str, level: int) -> None:
    assert level_of(line) == level
