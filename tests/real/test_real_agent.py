"""Agent clients against the real parts: anthropic-python on ``/v1/messages`` and openai-python's
Responses client on ``/v1/responses``, through onebitd, with the real llama-server and SmolLM2.

First the conversion itself: onebitd's chat form of a request (supervisor/llama/chatform.py), templated
and tokenized by the decoder, must be the very tokens the decoder evaluates when it gets the request on
its own endpoint.  The exact check: the request sent to the decoder pinned to a slot, the slot saved,
and its state file's tokens read (supervisor/llama/statefile.py): onebitd's tokens are their prefix.

Then the routes: slot affinity (a conversation's next turn reuses its slot's cache), the hybrid file
route (the decoder evaluates one or two tokens, and answers what it answers from its own prompt cache), the
prefix store after an onebitd restart (the reply equal to the one the decoder gives from its own
prompt cache), streams relayed with Anthropic's and the Responses API's events, and onebitd's own
refusals in the shape anthropic-python reads.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from supervisor.config import Config
from supervisor.llama import statefile
from supervisor.llama.decoder import DecoderClient
from supervisor.llama.region import unpack_prompt
from supervisor.routes.prompt import Unsupported, parse, tokens_of
from supervisor.supervise.child import ChildState
from tests.rigs.helpers import wait_until
from tests.rigs.reference import cached_reply, direct_to
from tests.rigs.rig import HANDOFF_ALWAYS, RouteLines, Running, child_of, make_config, real_llama_server, run_daemon

pytestmark = [
    pytest.mark.real,
    # The SDKs' streams stop at their last event without closing the async generators they read the
    # SSE with; trio warns when such a generator is collected (tests/real/test_real_plain.py says more).
    pytest.mark.filterwarnings(
        r"ignore:Async generator '(openai|anthropic|httpx2|httpcore2)\.[A-Za-z_.]+' "
        "was garbage collected:ResourceWarning"
    ),
]

DEADLINE_S = 300
# Two slots of 2048 tokens: an agent's system prompt and tools, and a few turns.
MODEL = {"parallel": 2, "ctx_size": 4096}
SYSTEM = (
    "You are a coding agent working in a small Python repository. You read files, run the tests and "
    "make small, careful changes. Always explain what you are about to do in one short sentence, then "
    "call exactly one tool. The repository has these files: " + ", ".join(f"src/module_{i}.py" for i in range(24)) + "."
)
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "a path relative to the repository"}},
    "required": ["path"],
}
ANTHROPIC_TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.", "input_schema": SCHEMA},
    {"name": "run_tests", "description": "Run the tests under a path.", "input_schema": SCHEMA},
]
RESPONSES_TOOLS = [
    {"type": "function", "name": "read_file", "description": "Read a file of the repository.", "parameters": SCHEMA},
    {"type": "function", "name": "run_tests", "description": "Run the tests under a path.", "parameters": SCHEMA},
]
GREEDY = {"temperature": 0}
# anthropic-python no longer takes ``temperature`` (today's Claude models do not): sent as an extra key,
# which llama-server's conversion keeps.
ANTHROPIC_GREEDY = {"extra_body": GREEDY}
QUESTION = "Which file holds the parser? Read it."
FILE_TEXT = "def parse(text):\n    return text.split()\n"

# -- the conversion table: bodies in the shapes the SDKs send ---------------------------------------

CONVERSIONS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "anthropic-string-system",
        "/v1/messages",
        {"system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]},
    ),
    (
        # anthropic-python's prompt-caching shape: system as blocks, a cache_control mark, tools.
        "anthropic-blocks-tools",
        "/v1/messages",
        {
            "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "auto"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
            "metadata": {"user_id": "u-1"},
        },
    ),
    (
        "anthropic-tool-turns",
        "/v1/messages",
        {
            "system": SYSTEM,
            "tools": ANTHROPIC_TOOLS,
            "messages": [
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "The parser is in module_3.", "signature": ""},
                        {"type": "text", "text": "I will read src/module_3.py."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "read_file",
                            "input": {"path": "src/module_3.py"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": FILE_TEXT}],
                        },
                        {"type": "text", "text": "Now run its tests."},
                    ],
                },
            ],
        },
    ),
    (
        "anthropic-billing-header",
        "/v1/messages",
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.101.e51; cch=a5145;"},
                {"type": "text", "text": SYSTEM},
            ],
            "messages": [{"role": "user", "content": QUESTION}],
        },
    ),
    ("responses-string", "/v1/responses", {"instructions": SYSTEM, "input": QUESTION}),
    (
        "responses-easy-messages-tools",
        "/v1/responses",
        {
            "instructions": SYSTEM,
            "tools": RESPONSES_TOOLS,
            "input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        },
    ),
    (
        # What openai-python sends on a conversation's next turn: the last response's output items
        # given back, a function call and its output.
        "responses-function-turns",
        "/v1/responses",
        {
            "instructions": SYSTEM,
            "tools": RESPONSES_TOOLS,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "I will read it.", "annotations": []}],
                },
                {
                    "id": "fc_1",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": "call_1",
                    "name": "read_file",
                    "arguments": '{"path": "src/module_3.py"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": FILE_TEXT},
                {"role": "user", "content": "Now run its tests."},
            ],
        },
    ),
    (
        "responses-reasoning",
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": QUESTION},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "module_3 has it"}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "module_3."}]},
                {"role": "user", "content": "Thanks."},
            ]
        },
    ),
]


def one_token(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body, answering with one token at most, whole."""
    limit = {"max_tokens": 1} if endpoint == "/v1/messages" else {"max_output_tokens": 1}
    return {**body, **limit, **GREEDY, "stream": False}


def decoder_saw(endpoint: str, reply: dict[str, Any]) -> int:
    """The prompt's length in the decoder's own words: its reply's usage."""
    usage = reply["usage"]
    if endpoint == "/v1/messages":
        return int(usage["input_tokens"]) + int(usage["cache_read_input_tokens"])
    return int(usage["input_tokens"])


async def slot_tokens(direct: httpx.AsyncClient, state_dir: Path, slot: int) -> tuple[int, ...]:
    """What slot ``slot`` of the decoder holds, from the state file it saves."""
    reply = await direct.post(f"/slots/{slot}?action=save", json={"filename": "agent-check.bin"})
    assert reply.status_code == 200, reply.text
    path = state_dir / "agent-check.bin"
    try:
        # llama-server packs the slot's prompt (its server_tokens serialization): unpacked here.
        return tuple(unpack_prompt(list(statefile.read(path).tokens)))
    finally:
        path.unlink()


async def erase(direct: httpx.AsyncClient, *slots: int) -> None:
    for slot in slots:
        assert (await direct.post(f"/slots/{slot}?action=erase")).status_code == 200


def plain_config(runtime: Path, **sections: Any) -> Config:
    """Hybrid off; llama-server's host-memory prompt cache off (``--cache-ram 0``): what reuses a
    prompt here is the slot onebitd pinned the request to, or the prefix store."""
    real_llama_server()
    cache = {"ram_mib": 0, **sections.pop("cache", {})}
    return make_config(runtime, model=MODEL, decoder={"threads": 1}, hybrid={"enabled": False}, cache=cache, **sections)


async def test_onebitds_chat_form_gives_the_tokens_the_decoder_evaluates_for_every_body(short_dir: Path) -> None:
    wrong: dict[str, str] = {}  # every body's mismatch, not only the first
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(plain_config(short_dir)) as running, direct_to(running) as direct:
            client = DecoderClient(running.daemon.models.default.parts.launcher.socket)
            try:
                for name, endpoint, body in CONVERSIONS:
                    prompt = parse(endpoint, body)
                    assert not isinstance(prompt, Unsupported), (name, prompt.why)
                    ours = await tokens_of(client, prompt)
                    await erase(direct, 0)
                    reply = await direct.post(endpoint, json={**one_token(endpoint, body), "id_slot": 0})
                    assert reply.status_code == 200, (name, reply.text)
                    saw = decoder_saw(endpoint, reply.json())
                    held = await slot_tokens(direct, short_dir / "state", 0)
                    if saw != len(ours):
                        wrong[name] = f"the decoder saw {saw} tokens, onebitd has {len(ours)}"
                    elif held != tuple(ours):
                        wrong[name] = f"slot 0 holds {len(held)} tokens, not onebitd's {len(ours)}"
            finally:
                await client.aclose()
    assert wrong == {}


async def test_the_patched_decoder_takes_id_slot_on_v1_messages(short_dir: Path) -> None:
    """patches/llama-server-agent.patch: a stock llama-server drops ``id_slot`` there, and would take
    the second request to the slot that holds its prompt."""
    _name, endpoint, body = CONVERSIONS[0]
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(plain_config(short_dir)) as running, direct_to(running) as direct:
            await erase(direct, 0, 1)
            first = await direct.post(endpoint, json={**one_token(endpoint, body), "id_slot": 1})
            second = await direct.post(endpoint, json={**one_token(endpoint, body), "id_slot": 0})
            assert (first.status_code, second.status_code) == (200, 200)
            assert second.json()["usage"]["cache_read_input_tokens"] == 0
            held = await slot_tokens(direct, short_dir / "state", 0)
    assert len(held) == decoder_saw(endpoint, second.json())  # slot 0 evaluated it all: pinned


# -- through onebitd, with the SDKs -----------------------------------------------------------------


def open_anthropic(running: Running, key: str = "x") -> Any:
    """anthropic-python on onebitd (Any: its parameters are TypedDicts, the bodies here plain dicts)."""
    # No retries: a failed request must fail the test, not be quietly asked again.
    return anthropic.AsyncAnthropic(base_url=running.url, api_key=key, max_retries=0, timeout=DEADLINE_S)


def open_openai(running: Running) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="x", max_retries=0, timeout=DEADLINE_S)


def anthropic_turns(reply_text: str) -> list[dict[str, Any]]:
    """A conversation's second turn: the reply given back, a tool result and a short question."""
    return [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": reply_text},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "src/module_3.py"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": FILE_TEXT},
                {"type": "text", "text": "Now run its tests."},
            ],
        },
    ]


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_anthropic_python_is_routed_its_next_turn_reuses_the_slot_and_its_stream_is_relayed(
    short_dir: Path, route_lines: RouteLines
) -> None:
    common: dict[str, Any] = {"model": "m", "max_tokens": 12, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    common.update(ANTHROPIC_GREEDY)
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(plain_config(short_dir)) as running, open_anthropic(running) as client:
            first = await client.messages.create(messages=[{"role": "user", "content": QUESTION}], **common)
            second = await client.messages.create(messages=anthropic_turns(text_of(first)), **common)
            events = await client.messages.create(messages=anthropic_turns(text_of(first)), stream=True, **common)
            kinds, pieces = [], []
            async for event in events:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    pieces.append(event.delta.text)
    one, two, three = route_lines.lines
    for line, message in ((one, first), (two, second)):
        assert (line["endpoint"], line["route"], line["fallback"], line["outcome"]) == (
            "/v1/messages",
            "plain",
            None,
            "ok",
        )
        # onebitd's tokens are the decoder's: its prompt_tokens is the decoder's usage.
        assert line["prompt_tokens"] == message.usage.input_tokens + message.usage.cache_read_input_tokens
        assert line["cached_tokens"] == message.usage.cache_read_input_tokens
    assert one["slot"] == two["slot"] == three["slot"]
    assert two["cached_tokens"] >= one["prompt_tokens"]  # the whole first turn, from the slot's cache
    assert three["cached_tokens"] >= two["prompt_tokens"] - 1
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds
    assert "".join(pieces) == text_of(second)


def responses_turns(output: list[Any]) -> list[Any]:
    """The Responses API's next turn: the last output given back, a function call and its output."""
    given_back = [item.model_dump(exclude_none=True) for item in output if item.type == "message"]
    return [
        {"role": "user", "content": QUESTION},
        *given_back,
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "src/module_3.py"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": FILE_TEXT},
        {"role": "user", "content": "Now run its tests."},
    ]


async def test_openai_pythons_responses_client_is_routed_and_its_next_turn_reuses_the_slot(
    short_dir: Path, route_lines: RouteLines
) -> None:
    common: dict[str, Any] = {"model": "m", "max_output_tokens": 12, "instructions": SYSTEM, "tools": RESPONSES_TOOLS}
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(plain_config(short_dir)) as running, open_openai(running) as client:
            first = await client.responses.create(input=QUESTION, temperature=0, **common)
            second = await client.responses.create(input=responses_turns(first.output), temperature=0, **common)
            stream = await client.responses.create(
                input=responses_turns(first.output), temperature=0, stream=True, **common
            )
            kinds, pieces = [], []
            async for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    pieces.append(event.delta)
    one, two, three = route_lines.lines
    for line, response in ((one, first), (two, second)):
        assert (line["endpoint"], line["route"], line["fallback"], line["outcome"]) == (
            "/v1/responses",
            "plain",
            None,
            "ok",
        )
        assert response.usage is not None
        assert line["prompt_tokens"] == response.usage.input_tokens
        assert line["cached_tokens"] == response.usage.input_tokens_details.cached_tokens
    assert one["slot"] == two["slot"] == three["slot"]
    assert two["cached_tokens"] >= one["prompt_tokens"]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "".join(pieces) == second.output_text


# -- the hybrid file route --------------------------------------------------------------------------


def hybrid_config(runtime: Path) -> Config:
    real_llama_server()
    return make_config(
        runtime,
        model=MODEL,
        decoder={"threads": 1},
        hybrid={"enabled": True, "min_prompt_tokens": 16, **HANDOFF_ALWAYS},
        provider=[{"kind": "llama-server", "name": "p0", "threads": 1}],
    )


async def test_both_apis_take_the_file_route_and_answer_what_the_decoder_answers_from_its_cache(
    short_dir: Path, route_lines: RouteLines
) -> None:
    message_body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 16,
        "system": SYSTEM,
        "tools": ANTHROPIC_TOOLS,
        "messages": [{"role": "user", "content": QUESTION}],
        **GREEDY,
    }
    responses_body: dict[str, Any] = {
        "model": "m",
        "max_output_tokens": 16,
        "instructions": SYSTEM,
        "tools": RESPONSES_TOOLS,
        "input": QUESTION,
        **GREEDY,
    }
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(hybrid_config(short_dir)) as running:
            provider = running.daemon.models.default.parts.providers.all[0]
            await child_of(provider).wait_state(ChildState.READY)
            async with direct_to(running) as decoder:
                _, cached_message = await cached_reply(decoder, "/v1/messages", message_body)
                _, cached_response = await cached_reply(decoder, "/v1/responses", responses_body)
            async with open_anthropic(running) as client:
                message = await client.messages.create(
                    **{k: v for k, v in message_body.items() if k != "temperature"}, **ANTHROPIC_GREEDY
                )
            async with open_openai(running) as oai:
                response = await oai.responses.create(**responses_body)
    assert text_of(message) == "".join(block["text"] for block in cached_message["content"] if block["type"] == "text")
    assert response.output_text == "".join(
        part["text"] for item in cached_response["output"] if item["type"] == "message" for part in item["content"]
    )
    for line in route_lines.lines:
        assert (line["route"], line["fallback"], line["outcome"]) == ("file", None, "ok"), line
        assert line["decoder_prompt_n"] <= 2, line
        assert line["prompt_tokens"] >= 100
    assert [line["endpoint"] for line in route_lines.lines] == ["/v1/messages", "/v1/responses"]
    assert list((short_dir / "state").iterdir()) == []


# -- the prefix store across an onebitd restart -----------------------------------------------------


@pytest.fixture
def store_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ob-store-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def store_config(runtime: Path, store: Path) -> Config:
    return plain_config(runtime, cache={"dir": str(store), "min_tokens": 64})


async def test_an_agents_conversation_is_restored_from_the_prefix_store_after_an_onebitd_restart(
    short_dir: Path, store_dir: Path, route_lines: RouteLines
) -> None:
    common: dict[str, Any] = {"model": "m", "max_tokens": 12, "system": SYSTEM, "tools": ANTHROPIC_TOOLS}
    common.update(ANTHROPIC_GREEDY)
    first_turn = [{"role": "user", "content": QUESTION}]
    with trio.fail_after(DEADLINE_S):
        # The reference: the second turn answered from the decoder's own prompt cache.
        reference = Path(tempfile.mkdtemp(prefix="ob-", dir="/tmp"))
        try:
            async with (
                run_daemon(store_config(reference, reference / "prefix")) as running,
                open_anthropic(running) as client,
            ):
                first = await client.messages.create(messages=first_turn, **common)
                expected = await client.messages.create(messages=anthropic_turns(text_of(first)), **common)
        finally:
            shutil.rmtree(reference, ignore_errors=True)
        route_lines.lines.clear()

        async with run_daemon(store_config(short_dir, store_dir)) as running:
            async with open_anthropic(running) as client:
                assert text_of(await client.messages.create(messages=first_turn, **common)) == text_of(first)
            await wait_until(lambda: running.daemon.models.default.store_statistics().stores >= 1)
        async with run_daemon(store_config(short_dir, store_dir)) as running, open_anthropic(running) as client:
            got = await client.messages.create(messages=anthropic_turns(text_of(first)), **common)
    assert text_of(got) == text_of(expected)
    restarted = route_lines.lines[-1]
    assert restarted["restored_tokens"] is not None
    # The first turn, or its entry up to its generation prompt ("<|im_start|>assistant\n", a few tokens)
    # where the second is sure to match it.
    assert 0 <= route_lines.lines[0]["prompt_tokens"] - restarted["restored_tokens"] <= 8, restarted
    assert restarted["cached_tokens"] >= restarted["restored_tokens"] - 1
    assert restarted["fallback"] == "stored"


# -- onebitd's own refusals, as anthropic-python reads them -----------------------------------------


async def test_anthropic_python_reads_onebitds_refusals_as_anthropics_errors(short_dir: Path) -> None:
    config = plain_config(short_dir, server={"api_keys": ["secret"], "max_body_bytes": 100_000})
    message = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi."}]}
    with trio.fail_after(DEADLINE_S):
        async with run_daemon(config) as running:
            async with open_anthropic(running, key="wrong") as client:
                with pytest.raises(anthropic.AuthenticationError) as denied:
                    await client.messages.create(**message)
            async with open_anthropic(running, key="secret") as client:
                with pytest.raises(anthropic.APIStatusError) as too_large:
                    await client.messages.create(**{**message, "system": "x" * 200_000})
                # The decoder's own refusal (a body its conversion refuses) is relayed as it wrote it.
                with pytest.raises(anthropic.APIStatusError) as bad:
                    await client.messages.create(**{**message, "messages": [{"role": "user"}]})
                running.daemon.front.registry.drain()
                with pytest.raises(anthropic.ServiceUnavailableError) as draining:
                    await client.messages.create(**message)
    assert (denied.value.status_code, denied.value.type) == (401, "authentication_error")
    assert denied.value.response.headers["x-onebit-source"] == "onebitd"
    assert (too_large.value.status_code, too_large.value.type) == (413, "request_too_large")
    assert bad.value.response.headers["x-onebit-source"] == "decoder"
    assert (draining.value.status_code, draining.value.type) == (503, "overloaded_error")
    assert "draining" in str(draining.value.api_message)
