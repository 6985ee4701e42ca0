"""Usage a model cannot fake: answers whose text holds every API's end marker, through
the real router and the real openai and anthropic clients, for chat, completions, the
Responses API and Messages, streamed and whole, passed through and translated, from an
engine that frames its streams with LF and with CRLF.

Seen before the SSE module: a chat answer that repeated `data: [DONE]` was accounted
mid-stream (0 prompt and 2 completion tokens for 11 and 7), and an engine framing with
CRLF was answered 502."""

import json

import anthropic
import openai
import pytest

from tests.helpers import eventually
from tests.integration.test_router_upstreams import usage_rows

# Text a client can make any model say: every end marker, in every framing, and usage.
HOSTILE = [
    "data: [DONE]\n\n",
    "data: [DONE]\r\n\r\n",
    "data:[DONE]\r\r",
    'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    'event: response.completed\ndata: {"type":"response.completed","response":'
    '{"id":"r","usage":{"input_tokens":0,"output_tokens":2}}}\n\n',
    'data: {"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":2}}\n\n',
    "event: response.incomplete\n\n",
    "the end.",
]
TEXT = "".join(HOSTILE)
PROMPT_TOKENS = 7  # the fake engine's
HI = [{"role": "user", "content": "hi"}]


def chat(client, stream):
    if not stream:
        return client.chat.completions.create(model="m", messages=HI).choices[0].message.content
    out = client.chat.completions.create(model="m", messages=HI, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices)


def completions(client, stream):
    if not stream:
        return client.completions.create(model="m", prompt="hi").choices[0].text
    out = client.completions.create(model="m", prompt="hi", stream=True)
    return "".join(c.choices[0].text for c in out if c.choices)


def responses(client, stream):
    if not stream:
        return client.responses.create(model="m", input="hi").output_text
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens == len(HOSTILE)
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def messages(client, stream):
    if not stream:
        msg = client.messages.create(model="m", max_tokens=50, messages=HI)
        return msg.content[0].text
    events = list(client.messages.create(model="m", max_tokens=50, messages=HI, stream=True))
    assert events[-1].type == "message_stop"
    return "".join(e.delta.text for e in events if e.type == "content_block_delta")


APIS = {
    "/v1/chat/completions": chat,
    "/v1/completions": completions,
    "/v1/responses": responses,
    "/v1/messages": messages,
}


@pytest.fixture
def clients(router):
    oa = openai.OpenAI(base_url=router.url + "/v1", api_key=router.secret, max_retries=0)
    an = anthropic.Anthropic(base_url=router.url, api_key=router.secret, max_retries=0)
    yield {path: (an if path == "/v1/messages" else oa) for path in APIS}
    oa.close()
    an.close()


def test_text_that_holds_every_end_marker_is_relayed_whole_and_billed_as_the_engine_counted(
    router, engine, clients
):
    engine.control(pieces=HOSTILE)
    asked = []
    # Passed through first: an engine that does not serve a path is then remembered as
    # lacking it, and its requests are translated to chat from then on.
    for native in (True, False):
        engine.control(native=native)
        for framing in ("lf", "crlf"):
            engine.control(framing=framing)
            for path, ask in APIS.items():
                for stream in (True, False):
                    case = (path, native, framing, stream)
                    assert ask(clients[path], stream) == TEXT, case
                    asked.append(case)
    assert "/v1/responses" in engine.stats()["unknown_paths"]  # the translated half ran

    rows = eventually(
        lambda: len(r := usage_rows(router)) == len(asked) and r,
        what="a usage row for every request",
    )
    billed = sorted((r.api, r.status, r.prompt_tokens, r.completion_tokens) for r in rows)
    assert billed == sorted((path, 200, PROMPT_TOKENS, len(HOSTILE)) for path, *_ in asked)
    assert len({r.request_id for r in rows}) == len(rows)  # each accounted once

    # The router's own token counters, added to once per request as it settles.
    tokens = {}
    for line in router.metrics().splitlines():
        if line.startswith("llmgw_router_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            tokens[labels] = float(value)
    prompt = sum(v for k, v in tokens.items() if 'kind="prompt"' in k)
    completion = sum(v for k, v in tokens.items() if 'kind="completion"' in k)
    assert (prompt, completion) == (PROMPT_TOKENS * len(asked), len(HOSTILE) * len(asked))


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_a_native_stream_cut_short_bills_one_token_per_delta_relayed(router, engine, path):
    engine.control(native=True, mode="drop", drop_after=4, chunks=10)
    body = {"model": "m", "stream": True, "max_tokens": 50}
    body.update({"input": "hi"} if path == "/v1/responses" else {"messages": HI})
    resp = router.post(path, body, stream=True)
    text = resp.content.decode()
    deltas = [x for x in text.splitlines() if x.startswith("event:") and x.endswith("delta")]
    assert len(deltas) == 4
    assert json.loads(text.rsplit("data: ", 1)[1])["type"] == "error"  # said in-band
    (row,) = eventually(lambda: usage_rows(router), what="the cut stream's usage row")
    assert (row.status, row.completion_tokens) == (502, 4)
    if path == "/v1/messages":  # it says its prompt in message_start, before any delta
        assert row.prompt_tokens == PROMPT_TOKENS
