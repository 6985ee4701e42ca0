"""A request's spans, as OpenTelemetry's GenAI conventions name them: one SERVER span per
request (`chat MODEL`: the operation, the models asked and served, the tokens as the
usage row counts them, the time to the first chunk, the HTTP status, the request id),
and as its children the admission (the band's queue), each engine attempt (a CLIENT
span: endpoint, replica, status, why it was retried) and the stream.

Only while tracing is on (`llmgw.tracing.tracer`): the request path holds None
otherwise and calls nothing here. A request the sampler leaves out has a span that
records nothing (its context still goes to the engine, so the engine leaves it out
too), and no children at all.
"""

import time

from llmgw import tracing

# gen_ai.operation.name by the path a request came by; a path not here is its own name.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
    "/v1/rerank": "rerank",
    "/v1/reranking": "rerank",
}

_kinds = None


def _kind():
    """opentelemetry.trace.SpanKind, imported once tracing is on."""
    global _kinds
    if _kinds is None:
        from opentelemetry.trace import SpanKind

        _kinds = SpanKind
    return _kinds


def request_span(request, route, rid: str):
    """The request's span, the child of the caller's `traceparent` if it sent one."""
    op = OPERATIONS.get(route.path, route.path)
    span = tracing.tracer.start_span(
        op, context=tracing.parent(request.headers), kind=_kind().SERVER
    )
    if span.is_recording():
        span.set_attributes(
            {
                "gen_ai.operation.name": op,
                "http.request.method": "POST",
                "url.path": route.path,
                "llmgw.request_id": rid,
            }
        )
    return span


def asked(span, payload: dict) -> None:
    """What the request asks of the model, once its body is read."""
    attrs = {"gen_ai.request.model": str(payload.get("model", ""))[:200]}
    for field, name in (("max_tokens", "gen_ai.request.max_tokens"),
                        ("max_completion_tokens", "gen_ai.request.max_tokens"),
                        ("temperature", "gen_ai.request.temperature"),
                        ("top_p", "gen_ai.request.top_p")):  # fmt: skip
        value = payload.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[name] = value
    attrs["llmgw.stream"] = payload.get("stream") is True
    span.set_attributes(attrs)


def child(parent, name: str, kind=None, attributes=None):
    return tracing.tracer.start_span(
        name,
        context=tracing.context_of(parent),
        kind=kind if kind is not None else _kind().INTERNAL,
        attributes=attributes,
    )


def admission(parent, model: str, band: str):
    """The wait for a slot of `model` in the request's band (admission.py)."""
    return child(parent, "llmgw.admission", attributes={"gen_ai.request.model": model,
                                                        "llmgw.band": band})  # fmt: skip


def admitted(span, queued: bool, ok: bool) -> None:
    span.set_attributes({"llmgw.admission.queued": queued, "llmgw.admission.admitted": ok})
    if not ok:
        span.set_attribute("error.type", "model_saturated")
    span.end()


def attempt(parent, ep, model: str, n: int, op: str):
    """One engine attempt (CLIENT): where it went; `n` counts from 1."""
    host, _, port = ep.url.partition("://")[2].partition("/")[0].rpartition(":")
    attrs = {
        "gen_ai.operation.name": op,
        "gen_ai.request.model": model,
        "server.address": host,
        "url.full": ep.url,
        "llmgw.replica.id": ep.id,
        "llmgw.attempt": n,
    }
    if port.isdigit():
        attrs["server.port"] = int(port)
    if ep.engine:
        attrs["gen_ai.provider.name"] = ep.engine
    return child(parent, "llmgw.attempt", _kind().CLIENT, attrs)


def failed(span, kind: str, reason: str) -> None:
    """The attempt failed: why (another endpoint may be tried after it)."""
    span.set_attributes({"error.type": kind, "llmgw.retry_reason": reason[:300]})


def attempt_done(span, status: int | None) -> None:
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    span.end()


def traceparent_line(span) -> bytes:
    """The header line naming `span` the parent of what the engine does."""
    line = b"traceparent: " + tracing.traceparent(span).encode() + b"\r\n"
    state = span.get_span_context().trace_state
    if state:
        line += b"tracestate: " + state.to_header().encode() + b"\r\n"
    return line


class StreamSpan:
    """The stream's span, from the engine's first streamed byte to its end event: the
    first token as an event at the time the router relayed it."""

    __slots__ = ("span", "perf0", "wall0")

    def __init__(self, parent):
        self.perf0 = time.perf_counter()
        self.wall0 = time.time_ns()
        self.span = child(parent, "llmgw.stream", attributes=None)

    def done(self, call) -> None:
        span = self.span
        if call.t_first is not None and call.t_first >= self.perf0:
            at = self.wall0 + int((call.t_first - self.perf0) * 1e9)
            span.add_event("gen_ai.first_token", timestamp=at)
        meter = call.meter
        span.set_attributes(
            {
                "llmgw.stream.events": meter.events,
                "llmgw.stream.ended": bool(meter.ended),
                "gen_ai.usage.output_tokens": meter.completion,
            }
        )
        span.end()


def accounted(span, op: str, requested: str, served, engine: str, status: int, prompt: int,
              completion: int, cached, ttft, endpoint) -> None:  # fmt: skip
    """What the usage row says, on the request's span: the same numbers."""
    span.update_name(f"{op} {requested}" if requested else op)
    attrs = {
        "gen_ai.request.model": requested,
        "http.response.status_code": status,
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": completion,
    }
    if served:
        attrs["gen_ai.response.model"] = served
    if engine:
        # The provider is the engine that answered; gen_ai.system is its name before the
        # conventions renamed it, still read by some backends.
        attrs["gen_ai.provider.name"] = attrs["gen_ai.system"] = engine
    if cached is not None:
        attrs["gen_ai.usage.cache_read.input_tokens"] = cached
    if ttft is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = ttft
    if endpoint is not None:
        attrs["llmgw.replica.id"] = endpoint.id
    if status >= 500:
        attrs["error.type"] = str(status)
        from opentelemetry.trace import StatusCode

        span.set_status(StatusCode.ERROR)
    span.set_attributes(attrs)


def refused(span, status: int) -> None:
    """A request answered before it was read (no key): its status, and the span ends."""
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
    span.end()
