"""supervisor/routes/relay.py's Timings: what the decoder says it did, in every API's reply shape llama-server writes;
and the final-event check: the chunk that ends a stream, in each API llama-server streams."""

from __future__ import annotations

import json
from typing import Any

import pytest

from supervisor.routes.relay import SseScanner, Timings, has_final_event, sse_error

TIMINGS = {"cache_n": 90, "prompt_n": 10, "prompt_ms": 12.5}


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        pytest.param(
            {"timings": TIMINGS, "usage": {"prompt_tokens": 100, "completion_tokens": 3}},
            (10, 90, 12.5, 100),
            id="chat",
        ),
        pytest.param(
            # Anthropic's: no timings; input_tokens are the evaluated ones.
            {"type": "message", "usage": {"cache_read_input_tokens": 90, "input_tokens": 10, "output_tokens": 3}},
            (10, 90, None, 100),
            id="anthropic",
        ),
        pytest.param(
            {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 0, "input_tokens": 40}}},
            (40, 0, None, 40),
            id="anthropic-message-start",
        ),
        pytest.param(
            # The Responses API's: input_tokens are the whole prompt.
            {"object": "response", "usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 90}}},
            (10, 90, None, 100),
            id="responses",
        ),
        pytest.param(
            {
                "type": "response.completed",
                "response": {"usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 80}}},
                "timings": TIMINGS,
            },
            (10, 90, 12.5, 100),
            id="responses-completed-timings-win",
        ),
        pytest.param({"type": "message_delta", "usage": {"output_tokens": 3}}, (None, None, None, None), id="delta"),
    ],
)
def test_timings_read_every_apis_reply(reply: dict[str, Any], expected: tuple[Any, ...]) -> None:
    timings = Timings()
    timings.read(reply)
    assert (timings.prompt_n, timings.cache_n, timings.prompt_ms, timings.usage_prompt_tokens) == expected
    assert timings.prompt_tokens() == expected[3]


def test_an_anthropic_stream_says_what_the_decoder_evaluated_in_its_first_event() -> None:
    timings = Timings()
    scanner = SseScanner(timings)
    start = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 7, "input_tokens": 3}}}
    delta = {"type": "message_delta", "usage": {"output_tokens": 2}}
    for event, data in (("message_start", start), ("message_delta", delta), ("message_stop", {"type": "message_stop"})):
        scanner.feed(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())
    assert (timings.prompt_n, timings.cache_n, timings.prompt_tokens()) == (3, 7, 10)


def test_a_dropped_stream_ends_with_an_error_event_in_its_apis_shape() -> None:
    anthropic = sse_error("the decoder stopped mid-stream", anthropic=True)
    event, data = anthropic.decode().strip().split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "api_error", "message": "the decoder stopped mid-stream"},
    }
    openai = json.loads(sse_error("the decoder stopped mid-stream").decode().removeprefix("data: "))
    assert openai["error"]["code"] == "decoder_lost"


FINAL = [
    b"data: [DONE]\n\n",  # OpenAI's
    b"data:[DONE]\n\n",
    b'data: {"choices": []}\n\ndata: [DONE]\n\n',  # two events in one chunk
    b'event: message_stop\ndata: {"type": "message_stop"}\n\n',  # Anthropic's
    b'event: response.completed\ndata: {"type": "response.completed"}\n\n',  # the Responses API's
    b'data: {"content": "", "stop": true, "timings": {}}\n\n',  # llama.cpp's own /completion
    b'data: {"content":"","stop":true}\n\n',
]
NOT_FINAL = [
    b'data: {"choices":[{"text":" the","index":0,"finish_reason":null}]}\n\n',
    b'data: {"content": " the", "stop": false}\n\n',
    b'data: {"content": "true DONE message_stop completed", "stop": false}\n\n',  # the words in a token
    b'data: {"content": "data: [DONE]", "stop": false}\n\n',  # not at a line's start
    b"event: response.completed_soon\ndata: {}\n\n",
    b"",
]


@pytest.mark.parametrize("chunk", FINAL)
def test_a_chunk_with_the_stream_s_final_event_is_final(chunk: bytes) -> None:
    assert has_final_event(chunk)


@pytest.mark.parametrize("chunk", NOT_FINAL)
def test_a_token_s_chunk_is_not_final_whatever_words_its_text_holds(chunk: bytes) -> None:
    assert not has_final_event(chunk)
