"""The route line's logfmt: each value written bare where it can be, quoted as JSON where it cannot."""

from __future__ import annotations

import json

import pytest

from supervisor.routeline import RouteLine

QUOTED = ["", "two words", 'a "quote"', "a=b", "back\\slash", "line\nbreak", "tab\there", "\x00"]


@pytest.mark.parametrize("error", QUOTED)
def test_a_value_that_would_not_read_back_bare_is_quoted(error: str) -> None:
    line = RouteLine(req="1-1", endpoint="/completion", error=error)
    assert line.logfmt().endswith(f" error={json.dumps(error)}")


@pytest.mark.parametrize("error", ["decoder_lost", "/v1/completions", "é", "\x7f", "a-b_c.d:e"])
def test_a_value_without_space_quote_equals_backslash_or_control_character_is_bare(error: str) -> None:
    line = RouteLine(req="1-1", endpoint="/completion", error=error)
    assert line.logfmt().endswith(f" error={error}")


def test_every_field_is_on_the_line_in_order_with_absent_ones_as_a_dash() -> None:
    line = RouteLine(req="1-1", endpoint="/completion", status=200, total_ms=12.34, share_ms=0.5, prefill_ms=0.0)
    text = line.logfmt()
    assert text.startswith("route=plain req=1-1 endpoint=/completion status=200 outcome=ok fallback=- ")
    for field in ("prefill_ms=0", "share_ms=0.500", "total_ms=12.3"):
        assert f" {field} " in text
    assert [part.split("=")[0] for part in text.split(" ")] == list(line.fields())
