"""A request's spans, as OpenTelemetry's GenAI conventions name them: one SERVER span per
request (`chat MODEL`: the operation, the models asked and served, the tokens as the
usage row counts them, the time to the first chunk, the HTTP status, the request id),
and as its children the admission (a wait in the band's queue), each engine attempt (a
CLIENT span: endpoint, replica, status, why it was retried) and the stream.

Only while tracing is on (`llmgw.tracing.tracer`): the request path holds None
otherwise and calls nothing here. A request the sampler leaves out has a span that
records nothing (its context still goes to the engine, so the engine leaves it out
too), and no children at all.
"""

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


def request_span(request, route, rid: str):
    """The request's span, the child of the caller's `traceparent` if it sent one. Its
    attributes are set once, when it is accounted."""
    op = OPERATIONS.get(route.path, route.path)
    return tracing.start(op, tracing.SERVER, tracing.parent(request.headers))


def asked(span, payload: dict) -> None:
    """What the request asks of the model beyond its name, once its body is read."""
    value = payload.get("max_tokens") or payload.get("max_completion_tokens")
    if isinstance(value, int) and not isinstance(value, bool):
        span.set_attribute("gen_ai.request.max_tokens", value)


def child(parent, name: str, kind: int = tracing.INTERNAL, attributes=None):
    return tracing.child(parent, name, kind, attributes)


def admission(parent, model: str, queues, band: int):
    """The wait in `model`'s queue for the request's band (admission.py): only for a
    request that found no free slot (a span of no wait would cost as much as any)."""
    name = queues.bands[min(band, len(queues.bands) - 1)]
    return child(parent, "llmgw.admission", attributes={"gen_ai.request.model": model,
                                                        "llmgw.band": name})  # fmt: skip


def admitted(span, ok: bool) -> None:
    span.set_attribute("llmgw.admission.admitted", ok)
    if not ok:
        span.set_attribute("error.type", "model_saturated")
    span.end()


def attempt(parent, ep, n: int):
    """One engine attempt (CLIENT): where it went; `n` counts from 1. (The operation, the
    models and the provider are the request span's.)"""
    host, _, port = ep.url.partition("://")[2].partition("/")[0].rpartition(":")
    attrs = {"server.address": host, "llmgw.replica.id": ep.id, "llmgw.attempt": n}
    if port.isdigit():
        attrs["server.port"] = int(port)
    return child(parent, "llmgw.attempt", tracing.CLIENT, attrs)


def failed(span, kind: str, reason: str) -> None:
    """The attempt failed: why (another endpoint may be tried after it)."""
    span.set_attributes({"error.type": kind, "llmgw.retry_reason": reason[:300]})


def attempt_done(span, status: int | None) -> None:
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    span.end()


def traceparent_line(span) -> bytes:
    """The header lines naming `span` the parent of what the engine does."""
    line = b"traceparent: 00-%032x-%016x-%02x\r\n" % (span.trace_id, span.span_id, span.trace_flags)
    if span.trace_state:
        line += b"tracestate: " + span.trace_state.encode() + b"\r\n"
    return line


def stream(parent):
    """The stream's span, from the engine's first streamed byte to its end (the time to
    the first token is the request span's)."""
    return child(parent, "llmgw.stream")


def stream_done(span, call) -> None:
    meter = call.meter
    span.set_attributes({"llmgw.stream.events": meter.events,
                         "llmgw.stream.ended": bool(meter.ended)})  # fmt: skip
    span.end()


def accounted(span, op: str, path: str, rid: str, requested: str, served, engine: str,
              status: int, prompt: int, completion: int, cached, ttft) -> None:  # fmt: skip
    """What the usage row says, on the request's span: the same numbers."""
    span.update_name(f"{op} {requested}" if requested else op)
    attrs = {
        "gen_ai.operation.name": op,
        "gen_ai.request.model": requested,
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": completion,
        "http.response.status_code": status,
        "url.path": path,
        "llmgw.request_id": rid,
    }
    if served:
        attrs["gen_ai.response.model"] = served
    if engine:  # the provider is the engine that answered (llama.cpp, vllm)
        attrs["gen_ai.provider.name"] = engine
    if cached is not None:
        attrs["gen_ai.usage.cache_read.input_tokens"] = cached
    if ttft is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = ttft
    if status >= 500:
        attrs["error.type"] = str(status)
        span.set_status(tracing.ERROR)
    span.set_attributes(attrs)


def refused(span, path: str, rid: str, status: int) -> None:
    """A request answered before it was read (no key): its status, and the span ends."""
    if span.is_recording():
        attrs = {
            "gen_ai.operation.name": OPERATIONS.get(path, path),
            "url.path": path,
            "llmgw.request_id": rid,
        }
        attrs["http.response.status_code"] = status
        span.set_attributes(attrs)
    span.end()
