"""Anthropic's Messages and OpenAI's Responses requests in chat-completions form, as llama-server makes it.

llama-server answers ``/v1/messages`` and ``/v1/responses`` by converting the body into a chat
completion request, which it then templates like any other (tools/server/server-chat.cpp of build
11434: ``server_chat_convert_anthropic_to_oai`` and ``server_chat_convert_responses_to_chatcmpl``).
These are the same conversions, step for step and key for key (llama.cpp's JSON keeps the order keys
were added in, and a template that renders a tool with ``tojson`` sees that order), so the decoder's
``/apply-template`` and ``/tokenize`` give onebitd the very tokens the decoder evaluates (no I/O).

A conversion that differs from llama-server's costs reuse, never correctness (the decoder compares
the tokens it holds with the prompt's); tests/real/test_real_agent.py holds the two equal on real bodies.
A body llama-server would refuse raises :class:`~supervisor.errors.ChatFormRefused`: the request is
sent on as it is, and the decoder answers it with its own error.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from ..errors import ChatFormRefused

MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"
ENDPOINTS = (MESSAGES, RESPONSES)

# The Anthropic parameters llama-server keeps as they are; ``id_slot`` and ``cache_prompt`` only with
# patches/llama-server-agent.patch (a stock build drops them, and cannot be pinned on /v1/messages).
_ANTHROPIC_KEPT = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_ANTHROPIC_SLOT_KEYS = ("id_slot", "cache_prompt")
_BILLING_HEADER = "x-anthropic-billing-header:"
_CCH_LENGTH = 5  # the cch stamp's hex digits


def to_chat(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` of ``endpoint`` (one of :data:`ENDPOINTS`) as the chat completion request llama-server
    makes of it.  Raises ChatFormRefused."""
    if endpoint == MESSAGES:
        return from_anthropic(body)
    if endpoint == RESPONSES:
        return from_responses(body)
    raise ValueError(f"no chat form for {endpoint}")


def _value(data: Any, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """llama-server's ``json_value``: the key's value when it is there, not null and of the kind asked
    for, else the default."""
    if isinstance(data, dict):
        value = data.get(key)
        if value is not None and _is(value, kind):
            return value
    return default


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return isinstance(value, kind)


def _dump(value: Any) -> str:
    """nlohmann's ``dump()``: compact, UTF-8 kept as it is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# -- Anthropic --------------------------------------------------------------------------------------


def normalize_billing_header(text: str) -> str:
    """Claude Code's ``x-anthropic-billing-header: ...; cch=a5145;...`` system prompt has a stamp that
    changes on every request: llama-server writes it as ``fffff`` so the prefix cache gets past it."""
    if not text.startswith(_BILLING_HEADER):
        return text
    at = text.find("cch=", len(_BILLING_HEADER))
    if at < 0:
        return text
    start = at + 4
    if start + _CCH_LENGTH < len(text) and text[start + _CCH_LENGTH] == ";":
        return text[:start] + "f" * _CCH_LENGTH + text[start + _CCH_LENGTH :]
    return text


def _image_url(source: Any) -> dict[str, Any] | None:
    source_type = _value(source, "type", str, "")
    if source_type == "base64":
        media_type = _value(source, "media_type", str, "image/jpeg")
        data = _value(source, "data", str, "")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source_type == "url":
        return {"type": "image_url", "image_url": {"url": _value(source, "url", str, "")}}
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    tool_use_id = _value(block, "tool_use_id", str, "")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if not isinstance(content, list):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}
    text = ""
    parts: list[dict[str, Any]] = []
    has_images = False
    for part in content:
        part_type = _value(part, "type", str, "")
        if part_type == "text":
            piece = _value(part, "text", str, "")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif part_type == "image":
            has_images = True
            image = _image_url(_value(part, "source", dict, {}))
            if image is not None:
                parts.append(image)
    # Text only: one string, as llama-server collapses it.
    return {"role": "tool", "tool_call_id": tool_use_id, "content": parts if has_images else text}


def _anthropic_message(message: Any, into: list[Any]) -> None:
    role = _value(message, "role", str, "")
    if not isinstance(message, dict) or "content" not in message:
        if role != "assistant":
            into.append(message)
        return
    content = message["content"]
    if not isinstance(content, list):
        into.append(message)
        return
    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    tool_results: list[dict[str, Any]] = []
    reasoning = ""
    has_tool_calls = False
    for block in content:
        block_type = _value(block, "type", str, "")
        if block_type == "text":
            converted.append(block)
        elif block_type == "thinking":
            reasoning += _value(block, "thinking", str, "")
        elif block_type == "image":
            image = _image_url(_value(block, "source", dict, {}))
            if image is not None:
                converted.append(image)
        elif block_type == "tool_use":
            arguments = _dump(_value(block, "input", object, {}))
            function = {"name": _value(block, "name", str, ""), "arguments": arguments}
            tool_calls.append({"id": _value(block, "id", str, ""), "type": "function", "function": function})
            has_tool_calls = True
        elif block_type == "tool_result":
            tool_results.append(_tool_result(block))
    if converted or has_tool_calls or reasoning:
        new: dict[str, Any] = {"role": role}
        if converted:
            new["content"] = converted
        else:
            new["content"] = ""
        if tool_calls:
            new["tool_calls"] = tool_calls
        if reasoning:
            new["reasoning_content"] = reasoning
        into.append(new)
    into.extend(tool_results)


def from_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``server_chat_convert_anthropic_to_oai``: a new body, of only what it keeps."""
    messages: list[Any] = []
    system = body.get("system")
    if system is not None:
        text = ""
        if isinstance(system, str):
            text = normalize_billing_header(system)
        elif isinstance(system, list):
            for block in system:
                if _value(block, "type", str, "") == "text":
                    text += normalize_billing_header(_value(block, "text", str, ""))
        messages.append({"role": "system", "content": text})
    if "messages" not in body:
        raise ChatFormRefused("'messages' is required")
    given = body["messages"]
    if isinstance(given, list):
        for message in given:
            _anthropic_message(message, messages)
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _value(tool, "name", str, ""),
                    "description": _value(tool, "description", str, ""),
                    "parameters": tool["input_schema"] if isinstance(tool, dict) and "input_schema" in tool else {},
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        choice_type = _value(choice, "type", str, "")
        if choice_type == "auto":
            chat["tool_choice"] = "auto"
        elif choice_type in ("any", "tool"):
            chat["tool_choice"] = "required"
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    chat["max_tokens"] = body.get("max_tokens", 4096)
    for key in (*_ANTHROPIC_KEPT, *_ANTHROPIC_SLOT_KEYS):
        if key in body:
            chat[key] = body[key]
    if "thinking" in body:
        thinking = _value(body, "thinking", dict, {})
        if _value(thinking, "type", str, "") == "enabled":
            chat["thinking_budget_tokens"] = _value(thinking, "budget_tokens", int, 10000)
    if "metadata" in body:
        user_id = _value(_value(body, "metadata", dict, {}), "user_id", str, "")
        if user_id:
            chat["__metadata_user_id"] = user_id
    return chat


# -- OpenAI Responses -------------------------------------------------------------------------------


def _input_content(item: dict[str, Any]) -> list[dict[str, Any]]:
    """A user, system or developer message's parts."""
    parts: list[dict[str, Any]] = []
    for part in item["content"]:
        part_type = _value(part, "type", str, "")
        if part_type == "input_text":
            if not isinstance(part, dict) or "text" not in part:
                raise ChatFormRefused("'Input text' requires 'text'")
            parts.append({"text": part["text"], "type": "text"})
        elif part_type == "input_image":
            if not isinstance(part, dict) or "image_url" not in part:
                raise ChatFormRefused("'image_url' is required")
            parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif part_type == "input_file":
            raise ChatFormRefused("'input_file' is not supported by llamacpp at this moment")
        else:
            raise ChatFormRefused("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return parts


def _output_content(item: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's parts."""
    parts: list[dict[str, Any]] = []
    content = item.get("content")
    if isinstance(content, str):
        parts.append({"text": content, "type": "text"})
    elif isinstance(content, list):
        for part in content:
            part_type = _value(part, "type", str, "")
            if part_type in ("output_text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise ChatFormRefused("'Output text' requires 'text'")
                parts.append({"text": part["text"], "type": "text"})
            elif part_type == "refusal":
                if not isinstance(part.get("refusal"), str):
                    raise ChatFormRefused("'Refusal' requires 'refusal'")
                parts.append({"refusal": part["refusal"], "type": "refusal"})
            else:
                raise ChatFormRefused("'type' must be one of 'output_text' or 'refusal'")
    return parts


def _tool_output(item: dict[str, Any]) -> dict[str, Any]:
    output = item["output"]
    if isinstance(output, str):
        return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}
    parts = copy.deepcopy(output)
    for part in parts:
        if not isinstance(part, dict) or "type" not in part:
            raise ChatFormRefused("Output of tool call missing 'type' field")
        if part["type"] not in ("input_text", "input_image"):
            raise ChatFormRefused("Output of tool call should be 'Input text' or 'Input image'")
        if part["type"] == "input_text":
            part["type"] = "text"
        else:
            if "image_url" not in part:
                raise ChatFormRefused("'image_url' is required")
            part["type"] = "image_url"
            part["image_url"] = {"url": part["image_url"]}
    return {"content": parts, "role": "tool", "tool_call_id": item["call_id"]}


def _strings(item: dict[str, Any], *keys: str) -> bool:
    return all(isinstance(item.get(key), str) for key in keys)


def _responses_item(item: Any, messages: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise ChatFormRefused("Cannot determine type of 'item'")
    item = dict(item)
    merge = bool(messages) and messages[-1].get("role", "") == "assistant"
    if isinstance(item.get("content"), str):
        # A message given as a string: its one part, so that input and output messages read alike.
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role = item.get("role")
    if isinstance(item.get("content"), list) and role in ("user", "system", "developer"):
        parts = _input_content(item)
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = parts
        messages.append(item)
    elif role == "assistant" and item.get("type") == "message":
        parts = _output_content(item)
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("content"), list):
                previous["content"] = []
            previous["content"].extend(parts)
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif _strings(item, "arguments", "call_id", "name", "type") and item["type"] == "function_call":
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if merge:
            previous = messages[-1]
            if not isinstance(previous.get("tool_calls"), list):
                previous["tool_calls"] = []
            previous["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif (
        _strings(item, "call_id", "type")
        and isinstance(item.get("output"), str | list)
        and item["type"] == "function_call_output"
    ):
        messages.append(_tool_output(item))
    elif isinstance(item.get("summary"), list) and item.get("type") == "reasoning":
        content = item.get("content")
        if not isinstance(content, list):
            raise ChatFormRefused("item['content'] is not an array")
        if not content:
            raise ChatFormRefused("item['content'] is empty")
        if not isinstance(content[0], dict) or not isinstance(content[0].get("text"), str):
            raise ChatFormRefused("item['content']['text'] is not a string")
        if merge:
            messages[-1]["reasoning_content"] = content[0]["text"]
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": content[0]["text"]})
    else:
        raise ChatFormRefused("Cannot determine type of 'item'")


def from_responses(body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's ``server_chat_convert_responses_to_chatcmpl``: the whole body (``id_slot`` and
    ``cache_prompt`` with it), ``input`` and ``instructions`` made messages, the function tools made
    chat's."""
    if "input" not in body:
        raise ChatFormRefused("'input' is required")
    if _value(body, "previous_response_id", str, ""):
        raise ChatFormRefused("llama.cpp does not support 'previous_response_id'.")
    given = body["input"]
    chat = {key: value for key, value in body.items() if key != "input"}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _value(body, "instructions", str, "")})
        del chat["instructions"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _responses_item(item, messages)
    else:
        raise ChatFormRefused("'input' must be a string or array of objects")
    chat["messages"] = messages
    if "tools" in body:
        tools = body["tools"]
        if not isinstance(tools, list):
            raise ChatFormRefused("'tools' must be an array of objects")
        converted = []
        for tool in tools:
            if _value(tool, "type", str, "") != "function":
                continue  # no chat equivalent: llama-server skips it with a warning
            function = {key: value for key, value in tool.items() if key != "type"}
            function.setdefault("strict", True)
            converted.append({"type": "function", "function": function})
        del chat["tools"]
        if converted:
            chat["tools"] = converted
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        del chat["reasoning"]
    return chat
