"""supervisor/llama/chatform.py: llama-server's conversions of Anthropic and Responses bodies, step for step.

What each case expects is read off tools/server/server-chat.cpp (build 11434), key order included;
tests/real/test_real_agent.py holds the conversion equal to the real decoder's tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from supervisor.errors import ChatFormRefused
from supervisor.llama import chatform
from supervisor.llama.chatform import from_anthropic, from_responses, normalize_billing_header

TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_an_anthropic_body_becomes_a_new_chat_body_of_only_what_llama_server_keeps() -> None:
    body = {
        "model": "claude",
        "system": [{"type": "text", "text": "You are "}, {"type": "image"}, {"type": "text", "text": "terse."}],
        "messages": [{"role": "user", "content": "Read a.txt"}],
        "tools": [{"name": "read", "description": "Read a file", "input_schema": TOOL_SCHEMA}, {"name": "bare"}],
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
        "temperature": 0,
        "top_k": 1,
        "stream": True,
        "id_slot": 3,
        "cache_prompt": True,
        "metadata": {"user_id": "u1"},
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "service_tier": "auto",
    }
    chat = from_anthropic(body)
    assert chat == {
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Read a.txt"}],
        "tools": [
            {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": TOOL_SCHEMA}},
            {"type": "function", "function": {"name": "bare", "description": "", "parameters": {}}},
        ],
        "tool_choice": "required",
        "stop": ["END"],
        "max_tokens": 4096,
        "temperature": 0,
        "top_k": 1,
        "stream": True,
        "id_slot": 3,
        "cache_prompt": True,
        "thinking_budget_tokens": 64,
        "__metadata_user_id": "u1",
    }
    # Insertion order is the C++ order (llama.cpp's JSON keeps it): a template may render it.
    assert list(chat) == [
        "messages",
        "tools",
        "tool_choice",
        "stop",
        "max_tokens",
        "temperature",
        "top_k",
        "stream",
        "id_slot",
        "cache_prompt",
        "thinking_budget_tokens",
        "__metadata_user_id",
    ]
    assert list(chat["tools"][0]) == ["type", "function"]
    assert list(chat["tools"][0]["function"]) == ["name", "description", "parameters"]


def test_anthropic_tool_use_and_tool_result_turns_become_tool_calls_and_tool_messages() -> None:
    body = {
        "max_tokens": 10,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Read a.txt", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it.", "signature": ""},
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.txt", "é": 1.5}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "hello"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "plain"},
                    {"type": "tool_result", "tool_use_id": "t3"},
                    {"type": "text", "text": "Now summarize."},
                ],
            },
            {"role": "assistant"},
        ],
    }
    assert from_anthropic(body)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt", "cache_control": {"type": "ephemeral"}}]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a.txt","é":1.5}'}}
            ],
            "reasoning_content": "I should read it.",
        },
        # The message's own text first, then its tool results, in order.
        {"role": "user", "content": [{"type": "text", "text": "Now summarize."}]},
        {"role": "tool", "tool_call_id": "t1", "content": "hello"},
        {"role": "tool", "tool_call_id": "t2", "content": "plain"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
    ]


def test_anthropic_images_become_image_urls() -> None:
    source = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": source}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": source}]}
                ],
            },
        ]
    }
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert from_anthropic(body)["messages"] == [
        {"role": "user", "content": [url]},
        {"role": "tool", "tool_call_id": "t", "content": [url]},
    ]


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        (
            "x-anthropic-billing-header: cc_version=2.1.101.e51; cch=a5145;You are Claude Code.",
            "x-anthropic-billing-header: cc_version=2.1.101.e51; cch=fffff;You are Claude Code.",
        ),
        ("x-anthropic-billing-header: cch=a51;short", "x-anthropic-billing-header: cch=a51;short"),
        ("You are Claude Code. cch=a5145;", "You are Claude Code. cch=a5145;"),
    ],
)
def test_claude_codes_billing_stamp_is_written_as_llama_server_writes_it(text: str, normalized: str) -> None:
    assert normalize_billing_header(text) == normalized
    assert from_anthropic({"system": text, "messages": []})["messages"] == [{"role": "system", "content": normalized}]


def test_a_responses_body_keeps_every_key_and_gets_messages_and_chat_tools() -> None:
    tool = {"type": "function", "name": "read", "description": "Read a file", "parameters": TOOL_SCHEMA}
    body = {
        "model": "gpt",
        "instructions": "Be terse.",
        "input": "Read a.txt",
        "tools": [tool, {"type": "web_search"}, {**tool, "name": "strict", "strict": False}],
        "max_output_tokens": 12,
        "reasoning": {"effort": "low"},
        "id_slot": 1,
        "store": False,
    }
    chat = from_responses(body)
    assert list(chat) == ["model", "id_slot", "store", "messages", "tools", "max_tokens", "reasoning_effort"]
    assert chat["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Read a.txt"}]
    function = {"name": "read", "description": "Read a file", "parameters": TOOL_SCHEMA, "strict": True}
    assert chat["tools"] == [
        {"type": "function", "function": function},
        {"type": "function", "function": {**function, "name": "strict", "strict": False}},
    ]
    assert (chat["max_tokens"], chat["reasoning_effort"]) == (12, "low")


def test_responses_items_become_chat_turns_merged_into_the_assistants_as_llama_server_merges_them() -> None:
    body: dict[str, Any] = {
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read a.txt"}]},
            {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {
                "id": "msg",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Reading.", "annotations": []}],
            },
            {"type": "function_call", "id": "fc", "call_id": "c1", "name": "read", "arguments": '{"path":"a.txt"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "hello"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "hi"}]},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]},
        ]
    }
    assert from_responses(body)["messages"] == [
        {"role": "developer", "content": [{"text": "Use tools.", "type": "text"}]},
        {"role": "user", "content": [{"text": "Read a.txt", "type": "text"}]},
        {
            "role": "assistant",
            "content": [{"text": "Reading.", "type": "text"}],
            "reasoning_content": "hm",
            "tool_calls": [
                {"function": {"arguments": '{"path":"a.txt"}', "name": "read"}, "id": "c1", "type": "function"}
            ],
        },
        {"content": "hello", "role": "tool", "tool_call_id": "c1"},
        {"content": [{"type": "text", "text": "hi"}], "role": "tool", "tool_call_id": "c2"},
        {"role": "user", "content": [{"image_url": {"url": "data:x"}, "type": "image_url"}]},
    ]


def test_a_function_call_first_makes_an_assistant_turn_of_its_own() -> None:
    body = {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}
    call = {"function": {"arguments": "{}", "name": "f"}, "id": "c", "type": "function"}
    assert from_responses(body)["messages"] == [{"role": "assistant", "tool_calls": [call]}]


@pytest.mark.parametrize(
    ("endpoint", "body", "words"),
    [
        ("/v1/messages", {"max_tokens": 3}, "'messages' is required"),
        ("/v1/responses", {"model": "m"}, "'input' is required"),
        ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ("/v1/responses", {"input": 3}, "must be a string or array"),
        ("/v1/responses", {"input": [{"type": "mystery"}]}, "Cannot determine type"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ("/v1/responses", {"input": "x", "tools": {}}, "'tools' must be an array"),
    ],
)
def test_a_body_llama_server_refuses_is_refused_in_its_words(endpoint: str, body: dict[str, Any], words: str) -> None:
    with pytest.raises(ChatFormRefused, match=words):
        chatform.to_chat(endpoint, body)


def test_the_conversion_leaves_the_clients_body_as_it_was() -> None:
    body: dict[str, Any] = {
        "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "x"}]},
        ]
    }
    before = repr(body)
    from_responses(body)
    assert repr(body) == before
