"""The router's spans (traces.py) over the real request path in this process
(tests/fake_core.py), exported through the real exporter to a real OTLP receiver
(tests/otlp_receiver.py)."""

import asyncio
import re

import pytest

from llmgw import config, tracing
from llmgw_router import routes, traces
from llmgw_router.routing import Endpoint
from tests.fake_core import Core, models
from tests.otlp_receiver import Receiver

CATALOG = models({"name": "m"})
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = "b7ad6b7169203331"
TRACEPARENT = re.compile(rb"\r\ntraceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})\r\n")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10.0))


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.stop()


@pytest.fixture
def traced(receiver):
    """Tracing on, every request sampled unless its caller said otherwise."""
    tracing.setup(config.TracingConfig(endpoint=receiver.endpoint, sample_rate=1.0), "llmgw-router")
    yield receiver
    tracing.shutdown()


def two_engines() -> Core:
    eps = [Endpoint("e0", "http://e0:8001", ("m",)), Endpoint("e1", "http://e1:8002", ("m",))]
    return Core(eps, CATALOG)


def send(core: Core, secret: str, traceparent: str = "", body=None):
    request = core.request(routes.CHAT, secret, body or CHAT)
    if traceparent:
        request.headers["traceparent"] = traceparent
    return run(core.send(routes.CHAT, request))


def sent_traceparent(sent) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of the traceparent an engine was sent."""
    found = TRACEPARENT.search(sent.head)
    assert found, f"no traceparent in {sent.head!r}"
    trace_id, parent, flags = (g.decode() for g in found.groups())
    return trace_id, parent, bool(int(flags, 16) & 1)


def test_a_streamed_request_retried_on_another_engine_is_one_trace_under_its_callers_span(
    traced,
):
    core = two_engines()
    secret = core.key("k")
    core.engines.fail_next = [503]  # the first engine asked is overloaded
    got = send(core, secret, f"00-{TRACE}-{CALLER}-01")
    assert got.status == 200 and got.ended
    (row,) = core.usage.rows

    spans = traced.wait(lambda r: len(r.trace(TRACE)) >= 4 and r.trace(TRACE), what="4 spans")
    by = {}
    for s in spans:
        by.setdefault(s.name, []).append(s)
    (req,) = by["chat m"]
    assert (req.kind, req.parent_id, req.service) == ("SERVER", CALLER, "llmgw-router")
    a = req.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "m"
    assert a["gen_ai.usage.input_tokens"] == row.prompt_tokens > 0
    assert a["gen_ai.usage.output_tokens"] == row.completion_tokens > 0
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(row.ttft_ms / 1000)
    assert a["http.response.status_code"] == 200
    assert a["llmgw.request_id"] == row.request_id
    assert "llmgw.admission" not in by, "a free slot: no wait, no span"

    failed, answered = sorted(by["llmgw.attempt"], key=lambda s: s.attributes["llmgw.attempt"])
    for attempt in (failed, answered):
        assert (attempt.kind, attempt.parent_id) == ("CLIENT", req.span_id)
    assert failed.attributes["http.response.status_code"] == 503
    assert failed.attributes["error.type"] == "http_503"
    assert "HTTP 503" in failed.attributes["llmgw.retry_reason"]
    assert answered.attributes["http.response.status_code"] == 200
    assert "error.type" not in answered.attributes
    assert {failed.attributes["llmgw.replica.id"], answered.attributes["llmgw.replica.id"]} == {
        "e0",
        "e1",
    }
    assert answered.attributes["llmgw.replica.id"] == row.endpoint

    (stream,) = by["llmgw.stream"]
    assert stream.parent_id == answered.span_id
    assert stream.attributes["llmgw.stream.ended"] is True
    assert stream.attributes["llmgw.stream.events"] > 0

    # Each engine was told which attempt asked it: its spans join the same trace.
    heads = [sent_traceparent(s) for s in core.engines.sent]
    assert heads == [(TRACE, failed.span_id, True), (TRACE, answered.span_id, True)]


def test_a_request_the_sampler_leaves_out_records_nothing_but_still_tells_the_engine(receiver):
    tracing.setup(config.TracingConfig(endpoint=receiver.endpoint, sample_rate=0.0), "llmgw-router")
    try:
        core = two_engines()
        secret = core.key("k")
        assert send(core, secret).status == 200  # sampled by nobody
        unsampled = f"00-{'1' * 32}-{CALLER}-00"
        assert send(core, secret, unsampled).status == 200  # its caller did not sample it
        assert send(core, secret, f"00-{TRACE}-{CALLER}-01").status == 200  # its caller did
        heads = [sent_traceparent(s) for s in core.engines.sent]
        assert heads[0][2] is heads[1][2] is False
        assert heads[1][0] == "1" * 32  # the caller's trace, not sampled
        assert heads[2][0] == TRACE and heads[2][2] is True
        # Spans are exported in the order they end: once the sampled request's are in,
        # anything of the others would be too.
        receiver.wait(lambda r: len(r.trace(TRACE)) >= 3, what="the sampled request's spans")
    finally:
        tracing.shutdown()
    assert {s.trace_id for s in receiver.spans} == {TRACE}


def test_a_request_that_waited_for_a_slot_has_its_wait_as_a_span(traced):
    core = Core([Endpoint("e0", "http://e0:8001", ("m",))], CATALOG, slots={"m": 1})
    secret = core.key("k")
    hold = core.engines.engine("http://e0:8001").hold = asyncio.Event()

    async def go():
        first = asyncio.create_task(core.send(routes.CHAT, core.request(routes.CHAT, secret, CHAT)))
        while not core.engines.sent:
            await asyncio.sleep(0.001)
        second = core.request(routes.CHAT, secret, CHAT)
        second.headers["traceparent"] = f"00-{TRACE}-{CALLER}-01"
        waiting = asyncio.create_task(core.send(routes.CHAT, second))
        while core.admission.waiting.get("m") != 1:
            await asyncio.sleep(0.001)
        hold.set()
        return await first, await waiting

    assert [g.status for g in run(go())] == [200, 200]
    spans = traced.wait(lambda r: len(r.trace(TRACE)) >= 4 and r.trace(TRACE), what="4 spans")
    (req,) = [s for s in spans if s.name == "chat m"]
    (queue,) = [s for s in spans if s.name == "llmgw.admission"]
    assert queue.parent_id == req.span_id
    assert queue.attributes == {
        "gen_ai.request.model": "m",
        "llmgw.band": "bronze",
        "llmgw.admission.admitted": True,
    }
    (attempt,) = [s for s in spans if s.name == "llmgw.attempt"]
    assert queue.end_ns <= attempt.start_ns


def test_with_tracing_off_no_span_is_made_and_the_engine_hears_no_traceparent(monkeypatch):
    assert tracing.tracer is None

    def made(*args, **kw):
        raise AssertionError("a span was made with tracing off")

    monkeypatch.setattr(traces, "request_span", made)
    monkeypatch.setattr(traces, "child", made)
    core = two_engines()
    secret = core.key("k")
    assert send(core, secret, f"00-{TRACE}-{CALLER}-01").status == 200
    (sent,) = core.engines.sent
    assert b"traceparent" not in sent.head


def test_a_request_refused_at_the_door_is_a_span_with_its_status(traced):
    core = two_engines()
    core.key("k")
    got = send(core, "sk-wrong", f"00-{TRACE}-{CALLER}-01")
    assert got.status == 401
    (span,) = traced.wait(lambda r: r.trace(TRACE), what="the refused request's span")
    assert span.attributes["http.response.status_code"] == 401
    assert core.engines.sent == []
