"""The relay's final-event check: the chunk that ends a stream, in each API llama-server streams."""

from __future__ import annotations

import pytest

from supervisor.relay import has_final_event

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
