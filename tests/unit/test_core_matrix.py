"""The request path over the whole matrix, in process: each API (chat, completions,
Anthropic's Messages, Responses) × whole or streamed × passed through or translated to
chat × an engine that answers, fails before the client has a byte (and another answers,
or none does), or fails after. For each: what the client got, in its API's own shape;
the usage row; and that the request was accounted exactly once."""

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from llmgw_router import dialects, routes, sse
from llmgw_router.routing import Endpoint
from tests.fake_core import (
    BREAK_AFTER,
    BREAK_BEFORE,
    NO_END,
    REFUSE,
    WORDS,
    Client,
    Core,
    Engine,
    Got,
    PushingClient,
    models,
)

CATALOG = models({"name": "m", "pricing": {"input_per_mtok": 1.0, "output_per_mtok": 1.0}})
TEXT = "".join(WORDS)
PROMPT_TOKENS = 7  # what the fake engine says every prompt is


# -- each API as its client reads it -------------------------------------------------------


@dataclass(frozen=True)
class Api:
    name: str
    route: routes.Route
    body: dict
    text: Callable[[dict], str]  # a whole answer's text
    delta: Callable[[sse.Event], str | None]  # a content event's text; None: not content
    end: Callable[[sse.Event], bool]  # the event that ends a complete stream
    error_event: Callable[[sse.Event], bool]  # its in-band error
    error: Callable[[dict], bool]  # an error answer in its shape

    @property
    def translatable(self) -> bool:
        return self.route.api.translate is not None


def _obj(e: sse.Event) -> dict:
    obj = e.json()
    return obj if isinstance(obj, dict) else {}


def _choice(e: sse.Event) -> dict:
    choices = _obj(e).get("choices") or [{}]
    return choices[0]


def _openai_error(body: dict) -> bool:
    err = body.get("error")
    return set(body) == {"error"} and {"message", "type", "code"} <= set(err)


def _openai_error_event(e: sse.Event) -> bool:
    return not e.name and isinstance(_obj(e).get("error"), dict)


def _message_text(answer: dict) -> str:
    return "".join(b["text"] for b in answer["content"] if b["type"] == "text")


def _response_text(answer: dict) -> str:
    return "".join(
        part["text"]
        for item in answer["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def _anthropic_error(body: dict) -> bool:
    return body.get("type") == "error" and {"type", "message"} <= set(body["error"])


CHAT = Api(
    "chat", routes.CHAT,
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
    text=lambda a: a["choices"][0]["message"]["content"],
    delta=lambda e: (_choice(e).get("delta") or {}).get("content") or None,
    end=lambda e: e.data == sse.DONE,
    error_event=_openai_error_event,
    error=_openai_error,
)  # fmt: skip
COMPLETIONS = Api(
    "completions", routes.COMPLETIONS,
    {"model": "m", "prompt": "hi", "max_tokens": 50},
    text=lambda a: a["choices"][0]["text"],
    delta=lambda e: _choice(e).get("text") or None,
    end=lambda e: e.data == sse.DONE,
    error_event=_openai_error_event,
    error=_openai_error,
)  # fmt: skip
MESSAGES = Api(
    "messages", dialects.MESSAGES,
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
    text=_message_text,
    delta=lambda e: _obj(e)["delta"]["text"] if e.name == "content_block_delta" else None,
    end=lambda e: e.name == "message_stop",
    error_event=lambda e: e.name == "error" and _anthropic_error(_obj(e)),
    error=_anthropic_error,
)  # fmt: skip
RESPONSES = Api(
    "responses", dialects.RESPONSES_ROUTE,
    {"model": "m", "input": "hi", "max_output_tokens": 50},
    text=_response_text,
    delta=lambda e: _obj(e)["delta"] if e.name == "response.output_text.delta" else None,
    end=lambda e: e.name == "response.completed",
    error_event=lambda e: e.name == "error" and {"type", "message"} <= set(_obj(e)),
    error=_openai_error,  # the Responses API's errors are OpenAI's
)  # fmt: skip
APIS = (CHAT, COMPLETIONS, MESSAGES, RESPONSES)


# -- what the engines do, and what the client is to get ---------------------------------


ENGINES = 2  # every case has two engines that serve the model


@dataclass(frozen=True)
class Outcome:
    name: str
    fails: tuple = ()  # how the requests that reach an engine fail, in turn (fake_core)
    in_band: int = 0  # the stream breaks after this many content events reached the client
    cut: int = 0  # the engine's stream in pieces of this many bytes (0: one an event)
    client: type = Client

    @property
    def complete(self) -> bool:
        """The client gets the whole answer: a failure before its first byte is retried
        on another engine, while there is one."""
        return not self.in_band and len(self.fails) < ENGINES

    @property
    def streams_only(self) -> bool:
        return bool(self.in_band or self.cut or self.client is not Client)

    @property
    def status(self) -> int:
        """The usage row's status."""
        return 200 if self.complete else 502


OUTCOMES = (
    Outcome("answers"),
    Outcome("answers_in_pieces_cut_mid_event", cut=7),
    Outcome("answers_a_client_it_pushes_to", cut=7, client=PushingClient),
    Outcome("is_refused_and_another_engine_answers", (REFUSE,)),
    Outcome("gets_503_and_another_engine_answers", (503,)),
    Outcome("breaks_before_its_first_event_and_another_answers", (BREAK_BEFORE,)),
    Outcome("is_refused_by_every_engine", (REFUSE,) * ENGINES),
    Outcome("gets_503_from_every_engine", (503,) * ENGINES),
    Outcome("breaks_before_its_first_event_on_every_engine", (BREAK_BEFORE,) * ENGINES),
    Outcome("breaks_after_two_events", (BREAK_AFTER,), in_band=2),
    Outcome("breaks_after_two_events_pushed_in_pieces", (BREAK_AFTER,), 2, 7, PushingClient),
    Outcome("ends_without_its_end_event", (NO_END,), in_band=len(WORDS)),
)


def cases():
    for api in APIS:
        for stream in (False, True):
            for native in (True, False) if api.translatable else (True,):
                for out in OUTCOMES:
                    if out.streams_only and not stream:
                        continue
                    how = "native" if native else "translated"
                    name = f"{api.name}-{'stream' if stream else 'whole'}-{how}-{out.name}"
                    yield pytest.param(api, stream, native, out, id=name)


def two_engines(native: bool, cut: int = 0, keepalive_s: float = 3600.0) -> Core:
    eps = [Endpoint("e0", "http://e0", ("m",)), Endpoint("e1", "http://e1", ("m",))]
    return Core(eps, CATALOG, engine=Engine(native=native, cut=cut), keepalive_s=keepalive_s)


def events(body: bytes) -> list[sse.Event]:
    """The whole events of a stream as its client reads them (comments left out)."""
    framer = sse.Framer()
    got = framer.feed(body) + framer.close()
    assert not framer.pending, f"the stream ends inside an event: {body[-80:]!r}"
    return [e for e in map(sse.parse, got) if e.data is not None]


def run(coro):
    # A path that never ends (a retry loop) fails here, not at the suite's timeout.
    return asyncio.run(asyncio.wait_for(coro, 10.0))


@pytest.mark.parametrize("api, stream, native, outcome", list(cases()))
def test_each_api_answered_or_failed_reaches_its_client_in_its_shape_and_is_counted_once(
    api: Api, stream: bool, native: bool, outcome: Outcome
):
    core = two_engines(native, outcome.cut)
    secret = core.key("k", budget_cost=1.0)
    core.engines.fail_next = list(outcome.fails)
    request = core.request(api.route, secret, {**api.body, "stream": stream}, outcome.client)
    core.usage.watch = lambda: bytes(request.client.body) if request.client else b""
    got = run(core.send(api.route, request))

    # Who was asked: each failure on an engine of its own, then the answer from one that
    # had not failed; once the client had a byte, no other engine. An engine that lacks
    # the API's path is asked it once, then in chat, and is remembered.
    sent, failed = core.engines.sent, core.engines.failed
    assert len(failed) == len(outcome.fails) == len({f.url for f in failed}), sent
    if outcome.in_band:
        assert sent[-1] is failed[-1], "asked another engine after the client had bytes"
    for url in {s.url for s in sent}:
        paths = [s.path for s in sent if s.url == url]
        if native or not api.translatable:
            assert set(paths) == {api.route.path}
        else:
            assert paths[0] == api.route.path and paths.count(api.route.path) == 1
    answered = sent[-1].url
    if not native and outcome.complete:
        assert (answered, api.route.path) in core.proxy.up.lacking
    assert all(r.released == 1 for r in core.engines.replies), "every reply released once"

    (row,) = core.usage.rows  # one row a request, whatever happened
    assert row.status == outcome.status
    (cost,) = core.costs(secret)  # the reservation settled once, to what the row says
    assert cost.local == cost.limit - round((row.cost or 0.0) * 1_000_000)

    if outcome.complete:
        assert got.status == 200
        assert (row.prompt_tokens, row.completion_tokens) == (PROMPT_TOKENS, len(WORDS))
        assert "http://" + row.endpoint == answered not in {f.url for f in failed}
        assert got.headers["x-llmgw-served-model"] == "m"
        if stream:
            assert got.streamed and got.ended
            evs = events(got.body)
            assert "".join(filter(None, map(api.delta, evs))) == TEXT
            assert [api.end(e) for e in evs].count(True) == 1 and api.end(evs[-1])
            assert not any(map(api.error_event, evs))
            # The row is spooled before the client has the end: a crash between the two
            # cannot leave a complete answer without its row.
            (then,) = core.usage.seen
            assert not any(map(api.end, events(then)))
        else:
            answer = json.loads(got.body)
            assert api.text(answer) == TEXT
            assert answer["model"] == "m"
    elif outcome.in_band:
        # Too late for another engine: the client hears it in its stream, which ends
        # without its API's end event, and pays for what it was sent.
        assert got.streamed and got.status == 200 and got.ended
        evs = events(got.body)
        deltas = [d for d in map(api.delta, evs) if d is not None]
        assert "".join(deltas) == "".join(WORDS[: outcome.in_band])
        assert not any(map(api.end, evs))
        assert api.error_event(evs[-1]), evs[-1]
        assert row.completion_tokens == len(deltas)
    else:
        # Nothing reached the client: a whole error, in its API's shape.
        assert not got.streamed and got.status == 502
        assert api.error(json.loads(got.body)), got.body
        assert (row.prompt_tokens, row.completion_tokens) == (0, 0)

    if api is RESPONSES:  # a complete answer is kept for previous_response_id; no other
        assert core.conversations.pending() == (1 if outcome.complete else 0)


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_a_stream_that_arrives_whole_reaches_the_client_in_one_write_with_its_end(api: Api):
    """The engine's whole stream in one piece (a short answer, or a busy router): its
    events and the body's end go out together, one write (one system call) not two."""
    core = two_engines(native=True, cut=1 << 20)
    request = core.request(api.route, core.key("k"), {**api.body, "stream": True})
    got = run(core.send(api.route, request))
    assert got.streamed and got.ended and api.end(events(got.body)[-1])
    assert request.client.writes == 1


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def kept_alive_then(core: Core, api: Api, secret: str) -> Got:
    """A stream whose engines answer only once the client has had a keepalive."""
    hold = asyncio.Event()
    for url in ("http://e0", "http://e1"):
        core.engines.engine(url).hold = hold

    async def go():
        request = core.request(api.route, secret, {**api.body, "stream": True})
        answer = asyncio.create_task(core.send(api.route, request))
        await wait_for(lambda: request.client is not None and sse.KEEPALIVE in request.client.body)
        hold.set()
        return await answer

    return run(go())


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_a_stream_waiting_for_its_first_event_is_kept_alive_and_then_answered(api: Api):
    core = two_engines(native=True, keepalive_s=0.01)
    got = kept_alive_then(core, api, core.key("k"))
    assert got.streamed and got.ended and got.body.startswith(sse.KEEPALIVE)
    evs = events(got.body)
    assert "".join(filter(None, map(api.delta, evs))) == TEXT and api.end(evs[-1])
    (row,) = core.usage.rows
    assert (row.status, row.completion_tokens) == (200, len(WORDS))


@pytest.mark.parametrize(
    "api, native, fail",
    [
        pytest.param(CHAT, True, REFUSE, id="refused"),
        pytest.param(CHAT, True, 503, id="503"),
        pytest.param(CHAT, True, BREAK_BEFORE, id="broken_before_its_first_event"),
        pytest.param(MESSAGES, False, None, id="lacking_the_apis_path"),
    ],
)
def test_an_engine_failing_after_only_keepalives_went_out_is_passed_over_for_another(
    api: Api, native: bool, fail
):
    """A keepalive is no part of the answer: the client has had nothing an engine said,
    so another engine (or the same one, in chat) may still answer."""
    core = two_engines(native, keepalive_s=0.01)
    core.engines.fail_next = [fail] if fail is not None else []
    got = kept_alive_then(core, api, core.key("k"))
    assert got.body.startswith(sse.KEEPALIVE) and len(core.engines.failed) == (fail is not None)
    evs = events(got.body)
    assert not any(map(api.error_event, evs)), evs[-1]
    assert "".join(filter(None, map(api.delta, evs))) == TEXT and api.end(evs[-1])
    (row,) = core.usage.rows
    assert row.status == 200


@pytest.mark.parametrize("api", APIS, ids=lambda a: a.name)
def test_when_every_engine_fails_after_a_keepalive_the_client_hears_it_in_its_stream(api: Api):
    core = two_engines(native=True, keepalive_s=0.01)
    core.engines.fail_next = [503] * ENGINES
    got = kept_alive_then(core, api, core.key("k"))
    assert got.streamed and got.status == 200 and got.ended
    evs = events(got.body)
    assert len(evs) == 1 and api.error_event(evs[0]), evs
    assert len(core.engines.failed) == ENGINES, "each engine was tried"
    (row,) = core.usage.rows
    assert (row.status, row.completion_tokens) == (502, 0)
