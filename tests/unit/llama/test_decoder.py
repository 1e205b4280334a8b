"""llama-server's API, typed (supervisor/llama/decoder.py): what each call sends and how it reads the
answer, against a fake that records every request."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.errors import DecoderUnavailable
from supervisor.http import wire
from supervisor.llama import decoder


class Recorder:
    """A JsonClient whose answers are scripted: an exception is raised, a pair is the answer."""

    def __init__(self, *answers: tuple[int, Any] | Exception) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, Any]] = []

    async def post_json(self, path: str, body: Any) -> tuple[int, Any]:
        await trio.lowlevel.checkpoint()
        self.sent.append((path, body))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


GONE = DecoderUnavailable("decoder closed the connection without answering")


async def test_an_erase_that_got_no_answer_is_sent_again_up_to_its_tries() -> None:
    client = Recorder(GONE, (200, {"n_erased": 3}))
    assert await decoder.erase(client, 2, tries=2) is None
    assert client.sent == [("/slots/2?action=erase", {}), ("/slots/2?action=erase", {})]

    client = Recorder(GONE, GONE)
    refused = await decoder.erase(client, 2, tries=2)
    assert refused is not None
    assert (refused.status, refused.words, len(client.sent)) == (0, GONE.message, 2)


async def test_an_erase_is_sent_once_unless_asked_and_a_refusal_is_never_sent_again() -> None:
    client = Recorder(GONE)
    refused = await decoder.erase(client, 0)
    assert refused is not None
    assert (refused.status, len(client.sent)) == (0, 1)

    client = Recorder((400, {"error": {"message": "no such slot"}}))
    refused = await decoder.erase(client, 9, tries=2)
    assert refused is not None
    assert (refused.status, refused.words, len(client.sent)) == (400, "no such slot", 1)


async def test_next_token_asks_one_greedy_token_with_its_top_k_and_reads_what_was_evaluated() -> None:
    reply = {"completion_probabilities": [{"top_logprobs": []}], "timings": {"prompt_n": 1}}
    client = Recorder((200, reply))
    answer = await decoder.next_token(client, 1, [5, 6, 7], n_probs=20, cache=False)
    assert answer == decoder.NextToken(reply, 1)
    [(path, body)] = client.sent
    assert path == "/completion"
    assert body == {
        "prompt": [5, 6, 7],
        "n_predict": 1,
        "n_probs": 20,
        "temperature": 0,
        "id_slot": 1,
        "cache_prompt": False,
    }


async def test_next_token_refused_or_unanswered_is_a_refusal_in_llama_servers_words() -> None:
    answer = await decoder.next_token(Recorder((500, {"error": {"message": "boom"}})), 0, [1], n_probs=2, cache=True)
    assert isinstance(answer, decoder.Refusal)
    assert (answer.status, answer.words) == (500, "boom")
    answer = await decoder.next_token(Recorder(GONE), 0, [1], n_probs=2, cache=True)
    assert isinstance(answer, decoder.Refusal)
    assert (answer.status, answer.words) == (0, GONE.message)
    # A reply without timings says nothing of what was evaluated.
    answer = await decoder.next_token(Recorder((200, {})), 0, [1], n_probs=2, cache=True)
    assert answer == decoder.NextToken({}, None)


async def test_tokenize_parses_special_tokens_as_the_completion_path_does() -> None:
    client = Recorder((200, {"tokens": [1, 2]}))
    assert await decoder.tokenize(client, "<|im_start|>hi") == [1, 2]
    assert client.sent == [("/tokenize", {"content": "<|im_start|>hi", "add_special": True, "parse_special": True})]


class Paths:
    """A wire.Transport that answers 200 with an empty body and keeps each request's method and path."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    async def send(self, method: str, path: str, body: bytes | None, headers: wire.Headers = ()) -> wire.Response:
        await trio.lowlevel.checkpoint()
        self.sent.append((method, path))

        async def chunks() -> AsyncGenerator[bytes, None]:
            yield b""

        async def aclose() -> None:
            await trio.lowlevel.checkpoint()

        return wire.Response(200, {}, chunks, aclose)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@pytest.mark.parametrize(
    ("conversation", "path"),
    [("chat-1", "/v1/stream?conv_id=chat-1"), ("a b/c&d", "/v1/stream?conv_id=a%20b%2Fc%26d")],
)
async def test_a_stream_sessions_delete_names_its_conversation_quoted(conversation: str, path: str) -> None:
    transport = Paths()
    client = decoder.DecoderClient(Path("unused.sock"), transport=transport)
    reply = await decoder.delete_stream(client, conversation)
    assert reply.status == 200
    assert await decoder.decoder_metrics(client) == decoder.Reply(200, {}, b"")
    assert transport.sent == [("DELETE", path), ("GET", "/metrics")]
