"""Every Responses answer carries what the OpenResponses specification requires of a
response object: validated against its ResponseResource JSON schema
(tests/fixtures/openresponses/, with the spec's version), translated whole and
streamed, and llama-server's own answers once the router has shaped them."""

import json
from pathlib import Path

import jsonschema
import pytest

from llmgw_router import responses, sse
from tests.unit.test_responses import FN, STREAMS, events

SPEC = Path(__file__).parent.parent / "fixtures" / "openresponses"
SCHEMA = json.loads((SPEC / "response_resource.schema.json").read_text())


def problems(obj: dict, schema: str = "ResponseResource") -> list[str]:
    """What the spec's `schema` finds wrong with `obj`, one line each (none: valid)."""
    doc = {**SCHEMA, "$ref": f"#/components/schemas/{schema}"}
    found = jsonschema.Draft202012Validator(doc).iter_errors(obj)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


def shaped(resp: dict, request: dict) -> dict:
    """What the client gets: the router's shaping, then the JSON on the wire."""
    return json.loads(json.dumps(responses.spec_shaped(resp, request)))


REQUESTS = [
    {"model": "m", "input": "hi"},
    {"model": "m", "input": "hi", "instructions": "Be brief.", "temperature": 0.2, "top_p": 0.9,
     "max_output_tokens": 20, "metadata": {"ticket": "42"}, "user": "ada",
     "tools": [FN], "tool_choice": {"type": "function", "name": "get_weather"},
     "parallel_tool_calls": False, "text": {"format": {"type": "json_object"}},
     "truncation": "disabled"},
    {"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f"}],
     "tool_choice": "required", "reasoning": {"effort": "low"}, "store": False},
]  # fmt: skip

# llama-server's own /v1/responses answer, as its server-task.cpp writes it (whole, and
# the response in its stream's response.completed event): no instructions, tools,
# temperature, text... and no output_tokens_details.
LLAMA_SERVER = {
    "completed_at": 1760000001,
    "created_at": 1760000001,
    "id": "resp_abc",
    "model": "m",
    "object": "response",
    "output": [
        {"id": "rs_1", "summary": [], "type": "reasoning", "encrypted_content": "",
         "status": "completed",
         "content": [{"text": "Thinking.", "type": "reasoning_text"}]},
        {"content": [{"type": "output_text", "annotations": [], "logprobs": [],
                      "text": "Hello"}],
         "id": "msg_1", "role": "assistant", "status": "completed", "type": "message"},
        {"id": "fc_1", "type": "function_call", "status": "completed",
         "arguments": '{"city":"Oslo"}', "call_id": "call_1", "name": "get_weather"},
    ],
    "status": "completed",
    "usage": {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12,
              "input_tokens_details": {"cached_tokens": 3}},
}  # fmt: skip
LLAMA_SERVER_COMPLETED = {
    key: LLAMA_SERVER[key]
    for key in ("id", "object", "created_at", "status", "model", "output", "usage")
}


def test_llama_servers_own_answer_is_not_what_the_spec_requires():
    """The reason for shaping, and proof the schema test can fail."""
    assert problems(LLAMA_SERVER)
    assert problems(LLAMA_SERVER_COMPLETED)


@pytest.mark.parametrize("request_", REQUESTS)
@pytest.mark.parametrize("answer", [LLAMA_SERVER, LLAMA_SERVER_COMPLETED])
def test_a_native_answer_once_shaped_is_a_spec_response_object(request_, answer):
    resp = shaped(json.loads(json.dumps(answer)), request_)
    assert problems(resp) == []
    assert resp["output"] == answer["output"] and resp["usage"]["input_tokens"] == 7


def test_a_native_answer_says_the_requests_values_and_the_defaults_for_the_rest():
    resp = shaped(dict(LLAMA_SERVER_COMPLETED), REQUESTS[1])
    for name in ("instructions", "temperature", "top_p", "max_output_tokens", "metadata",
                 "user", "tool_choice", "parallel_tool_calls", "text"):  # fmt: skip
        assert resp[name] == REQUESTS[1][name], name
    assert resp["tools"] == [{**FN, "strict": None}]
    plain = shaped(dict(LLAMA_SERVER_COMPLETED), REQUESTS[0])
    assert (plain["temperature"], plain["top_p"], plain["tools"], plain["tool_choice"]) == (
        1.0, 1.0, [], "auto")  # fmt: skip
    assert (plain["text"], plain["metadata"], plain["reasoning"]) == (
        {"format": {"type": "text"}}, {}, None)  # fmt: skip
    assert plain["completed_at"] is not None and plain["background"] is False
    assert plain["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    assert plain["usage"]["input_tokens_details"] == {"cached_tokens": 3}


def test_what_the_engine_said_is_kept_over_the_request():
    resp = shaped({**LLAMA_SERVER, "temperature": 0.7, "instructions": "Its own."}, REQUESTS[1])
    assert (resp["temperature"], resp["instructions"]) == (0.7, "Its own.")


@pytest.mark.parametrize("request_", REQUESTS)
def test_a_translated_whole_answer_is_a_spec_response_object(request_):
    chat = {
        "choices": [{"finish_reason": "tool_calls", "message": {"content": "Let me look.",
            "tool_calls": [{"id": "call_a1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12},
    }  # fmt: skip
    resp = json.loads(json.dumps(responses.from_chat(chat, request_, "m")))
    assert problems(resp) == []
    cut = {"choices": [{"finish_reason": "length", "message": {"content": "Hel"}}]}
    assert problems(json.loads(json.dumps(responses.from_chat(cut, request_, "m")))) == []


@pytest.mark.parametrize("request_", REQUESTS)
@pytest.mark.parametrize("stream", ["text.sse", "tool_call.sse"])
def test_a_translated_streams_response_events_are_spec_events(request_, stream):
    got = events(responses.Stream(request_, "m").feed(sse.split((STREAMS / stream).read_bytes())))
    kinds = {
        "response.created": "ResponseCreatedStreamingEvent",
        "response.in_progress": "ResponseInProgressStreamingEvent",
        "response.completed": "ResponseCompletedStreamingEvent",
    }
    checked = [e for e in got if e["type"] in kinds]
    assert [e["type"] for e in checked] == list(kinds)
    for event in checked:
        assert problems(event, kinds[event["type"]]) == [], event["type"]
