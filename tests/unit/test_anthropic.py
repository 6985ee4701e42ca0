"""Anthropic Messages ↔ chat completions, both ways, on recorded chat chunks."""

import json
from pathlib import Path

import pytest

from llmgw_router import anthropic, sse
from llmgw_router.errors import Untranslatable

STREAMS = Path(__file__).parent.parent / "fixtures" / "chat_streams"

TOOL = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def events(data: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in data.split(b"\n\n"):
        if not block.strip():
            continue
        kind, payload = block.split(b"\n", 1)
        assert kind.startswith(b"event: ") and payload.startswith(b"data: ")
        out.append((kind[7:].decode(), json.loads(payload[6:])))
    return out


def test_a_system_prompt_in_blocks_and_a_conversation_become_chat_messages():
    chat = anthropic.to_chat(
        {
            "model": "m",
            "max_tokens": 20,
            "system": [
                {"type": "text", "text": "Be brief. "},
                {"type": "text", "text": "Be kind."},
            ],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "more", "cache_control": {}}],
                },
            ],
            "stop_sequences": ["\n\n"],
            "temperature": 0.2,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief. Be kind."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"},
        ],
        "max_tokens": 20,
        "stop": ["\n\n"],
        "temperature": 0.2,
    }


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages():
    chat = anthropic.to_chat(
        {
            "model": "m",
            "max_tokens": 20,
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [
                {"role": "user", "content": "weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },  # fmt: skip
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "4°C"},
                        {"type": "text", "text": "and?"},
                    ],
                },
            ],
        }
    )
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                          "parameters": TOOL["input_schema"]}}
    ]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "t1", "content": "4°C"},
        {"role": "user", "content": "and?"},
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"metadata": {"user_id": "u", "trace": "x"}}, "metadata.trace"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "x", "is_error": True}]}]},
         "messages[0].content[0].is_error"),
    ],
)  # fmt: skip
def test_a_field_chat_cannot_carry_is_refused_by_name_never_dropped(body, field):
    request = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(Untranslatable) as err:
        anthropic.to_chat({**request, **body})
    assert err.value.field == field


def test_a_chat_answer_with_a_tool_call_becomes_a_message_with_tool_use():
    chat = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "call_a1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                        }
                    ],
                },  # fmt: skip
            }
        ],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
    }
    msg = anthropic.from_chat(chat, "m")
    assert msg["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_a1", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    assert (msg["stop_reason"], msg["model"], msg["type"]) == ("tool_use", "m", "message")
    assert msg["usage"] == {"input_tokens": 40, "output_tokens": 12}


def test_a_chat_stream_becomes_the_full_messages_event_sequence():
    data = (STREAMS / "text.sse").read_bytes()
    stream = anthropic.Stream("m")
    # Fed as the router reads it: whole events, in batches that cut anywhere between them.
    parts = data.split(b"\n\n")
    out = stream.feed(sse.split(b"\n\n".join(parts[:2]) + b"\n\n"))
    out += stream.feed(sse.split(b"\n\n".join(parts[2:])))
    got = events(out)
    assert [k for k, _ in got] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert got[0][1]["message"]["model"] == "m"
    assert (
        "".join(d["delta"]["text"] for k, d in got if k == "content_block_delta") == "Hello there"
    )
    assert got[5][1]["delta"]["stop_reason"] == "max_tokens"
    assert got[5][1]["usage"] == {"input_tokens": 9, "output_tokens": 2}


def test_a_streamed_tool_call_becomes_a_tool_use_block_with_its_json_in_pieces():
    got = events(anthropic.Stream("m").feed(sse.split((STREAMS / "tool_call.sse").read_bytes())))
    starts = [d["content_block"] for k, d in got if k == "content_block_start"]
    assert starts == [
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_a1", "name": "get_weather", "input": {}},
    ]
    pieces = [d["delta"]["partial_json"] for k, d in got
              if k == "content_block_delta" and d["index"] == 1]  # fmt: skip
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    assert [k for k, _ in got].count("content_block_stop") == 2
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert got[-2][1]["usage"] == {"input_tokens": 40, "output_tokens": 12}
    assert got[-1][0] == "message_stop"


@pytest.mark.parametrize(
    ("status", "code", "want_status", "want_type"),
    [
        (401, "invalid_api_key", 401, "authentication_error"),
        (403, "model_not_allowed", 403, "permission_error"),
        (404, "model_not_found", 404, "not_found_error"),
        (400, "invalid_json", 400, "invalid_request_error"),
        (429, "rate_limited", 429, "rate_limit_error"),
        (503, "model_saturated", 529, "overloaded_error"),
        (502, "upstream_unavailable", 502, "api_error"),
    ],
)
def test_errors_take_anthropics_shape_and_status(status, code, want_status, want_type):
    body = {"error": {"message": "why", "type": "x", "param": None, "code": code}}
    assert anthropic.error(status, body) == (
        want_status,
        {"type": "error", "error": {"type": want_type, "message": "why"}},
    )
