"""The Responses API ↔ chat completions, both ways, on recorded chat chunks."""

import json
from pathlib import Path

import pytest

from llmgw_router import responses, sse
from llmgw_router.errors import Untranslatable

STREAMS = Path(__file__).parent.parent / "fixtures" / "chat_streams"

FN = {"type": "function", "name": "get_weather", "description": "Weather in a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip


def events(data: bytes) -> list[dict]:
    out = []
    for block in data.split(b"\n\n"):
        if block.strip():
            kind, payload = block.split(b"\n", 1)
            event = json.loads(payload[6:])
            assert kind == b"event: " + event["type"].encode()
            out.append(event)
    return out


def test_items_instructions_and_function_calls_become_chat_messages():
    chat = responses.to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "weather in Oslo?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": '{"city":"Oslo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "4°C"},
            ],
            "tools": [FN],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 30,
            "store": True,
        }
    )  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4°C"},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": FN["parameters"],
        "description": "Weather in a city"}}]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 30


def test_a_json_schema_format_becomes_a_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = responses.to_chat({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "thing", "schema": schema, "strict": True}}})  # fmt: skip
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"truncation": "auto"}, "truncation"),
    ],
)  # fmt: skip
def test_a_field_chat_cannot_carry_is_refused_by_name_never_dropped(body, field):
    with pytest.raises(Untranslatable) as err:
        responses.to_chat({"model": "m", "input": "hi", **body})
    assert err.value.field == field


def test_a_chat_answer_with_a_tool_call_becomes_output_items():
    chat = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me look.",
        "tool_calls": [{"id": "call_a1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12}}  # fmt: skip
    resp = responses.from_chat(chat, {"input": "x", "tools": [FN]}, "m")
    message, call = resp["output"]
    assert message["content"][0] == {"type": "output_text", "text": "Let me look.",
                                     "annotations": []}  # fmt: skip
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call", "call_a1", "get_weather", '{"city":"Oslo"}')  # fmt: skip
    assert resp["usage"]["input_tokens"] == 40 and resp["usage"]["total_tokens"] == 52
    assert (resp["status"], resp["model"], resp["tools"]) == (
        "completed",
        "m",
        [{**FN, "strict": None}],
    )
    # ... and as input items of the next turn.
    assert responses.history(resp["output"]) == [
        {"type": "message", "role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "call_a1", "name": "get_weather",
         "arguments": '{"city":"Oslo"}'},
    ]  # fmt: skip


def test_an_answer_cut_at_max_output_tokens_is_incomplete():
    chat = {"choices": [{"finish_reason": "length", "message": {"content": "Hel"}}]}
    resp = responses.from_chat(chat, {"input": "x"}, "m")
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_chat_stream_becomes_the_responses_event_sequence():
    got = events(
        responses.Stream({"input": "x"}, "m").feed(sse.split((STREAMS / "text.sse").read_bytes()))
    )
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert got[6]["text"] == "Hello there"
    done = got[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello there"
    assert done["usage"]["output_tokens"] == 2 and done["status"] == "incomplete"


def test_a_streamed_tool_call_becomes_a_function_call_item_with_its_arguments():
    stream = responses.Stream({"input": "x"}, "m")
    got = events(stream.feed(sse.split((STREAMS / "tool_call.sse").read_bytes())))
    pieces = [e["delta"] for e in got if e["type"] == "response.function_call_arguments.delta"]
    assert json.loads("".join(pieces)) == {"city": "Oslo"}
    done = got[-1]["response"]
    assert [i["type"] for i in done["output"]] == ["message", "function_call"]
    assert done["output"][1]["call_id"] == "call_a1"
    assert done["output"][1]["arguments"] == '{"city":"Oslo"}'
    assert done["usage"]["input_tokens"] == 40


def test_input_items_without_a_type_are_said_to_be_messages():
    assert responses.items([{"role": "assistant", "content": "hi"}, {"type": "x"}]) == [
        {"type": "message", "role": "assistant", "content": "hi"},
        {"type": "x"},
    ]
