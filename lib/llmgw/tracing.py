"""OpenTelemetry traces, off unless `[tracing] endpoint` is set.

While it is off, `tracer` is None and nothing of OpenTelemetry is imported or made:
the router checks `tracer is None` once a request, and `span()` hands out one shared
no-op. Once `setup()` has run, a sampled span is a small record (`Span`) that goes, when
it ends, to a bounded queue (spanqueue.py) whose one thread writes batches of them as
OTLP protobuf (otlp.py) and sends them with the SDK's OTLP/gRPC exporter. The SDK's own
spans, span processors and protobuf messages are not used: they cost the router about a
fifth more CPU per request at a 10% sample rate, these about a twentieth
(bench/TRACING.md); what reaches the collector is the same.

The sampler is parent-based: a request whose `traceparent` says its caller traced it
is traced, one whose caller did not is not, and the rest are traced at `sample_rate`
by their trace id, by the SDK's TraceIdRatioBased rule (so the router, the scheduler and
vLLM agree on a trace).
"""

import contextlib
import os
import random
import re
import socket
import traceback
from time import time_ns

from llmgw import __version__, log, otlp
from llmgw.errors import ConfigError
from llmgw.otlp import CLIENT, ERROR, INTERNAL, OK, SERVER  # noqa: F401 - for callers
from llmgw.spanqueue import EXPORT_FAILURES, SPANS_DROPPED, SPANS_EXPORTED  # noqa: F401

_log = log.get("llmgw.tracing")

# The queue sampled spans end into (spanqueue.SpanQueue) while tracing is on; None while
# it is off (the request path checks this).
tracer = None
_bound = 0  # a root whose trace id's low 64 bits are below this is sampled
_LOW64 = (1 << 64) - 1
_getrandbits = random.getrandbits
# W3C trace context: version, trace id, parent id, flags (and, past version 00, more).
_TRACEPARENT = re.compile(
    r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$"
)
_TRACESTATE_MEMBERS = 32  # at most, as W3C says; more and the header is ignored


def check(cfg) -> None:
    """ConfigError naming the bad [tracing] key, if one is."""
    if cfg.endpoint and not cfg.endpoint.startswith(("http://", "https://")):
        raise ConfigError(
            f"tracing.endpoint = {cfg.endpoint!r}: want http://HOST:PORT (or https://), the"
            " collector's OTLP/gRPC port, e.g. http://collector:4317"
        )
    if not 0.0 <= cfg.sample_rate <= 1.0:
        raise ConfigError(f"tracing.sample_rate = {cfg.sample_rate}: must be from 0 to 1")
    if cfg.queue_size <= 0:
        raise ConfigError(f"tracing.queue_size = {cfg.queue_size}: must be above 0")


def setup(cfg, service: str) -> bool:
    """Start tracing as `cfg` ([tracing]) says, as `service`; whether it is on."""
    global tracer, _bound
    check(cfg)
    if not cfg.endpoint:
        return False
    from opentelemetry.sdk.resources import Resource

    from llmgw import spanqueue

    # The SDK's resource: OTEL_RESOURCE_ATTRIBUTES and the telemetry.sdk.* attributes
    # join ours, as they did when the SDK made the spans.
    resource = Resource.create(
        {
            "service.name": cfg.service_name or service,
            "service.namespace": "llmgw",
            "service.version": __version__,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        }
    )
    encoder = otlp.Encoder(dict(resource.attributes), "llmgw", __version__)
    exporter = spanqueue.grpc_exporter(cfg.endpoint)
    queue = spanqueue.SpanQueue(encoder.request, exporter, cfg.queue_size, cfg.endpoint)
    _bound = round(cfg.sample_rate * (1 << 64))  # TraceIdRatioBased.get_bound_for_rate
    queue.start()
    tracer = queue
    _log.info("tracing", endpoint=cfg.endpoint, sample_rate=cfg.sample_rate,
              service=cfg.service_name or service)  # fmt: skip
    return True


def shutdown(timeout_s: float = 2.0) -> None:
    """Send what is queued, waiting at most `timeout_s` (a dead collector is not waited
    for longer), and stop; tracing is off after."""
    global tracer
    queue, tracer = tracer, None
    if queue is not None:
        queue.shutdown(timeout_s)


class Caller:
    """The trace context a caller's `traceparent` (and `tracestate`) carry."""

    __slots__ = ("trace_id", "span_id", "sampled", "trace_state")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, trace_state: str):
        self.trace_id, self.span_id = trace_id, span_id
        self.sampled, self.trace_state = sampled, trace_state


def parent(headers) -> Caller | None:
    """The caller's trace context, from a request's headers; None for none (or one that
    is not W3C trace context: the request is then a root)."""
    value = headers.get("traceparent") if tracer is not None else None
    if value is None:
        return None
    found = _TRACEPARENT.match(value)
    if found is None:
        return None
    version, trace, span_id, flags, more = found.groups()
    if version == "ff" or (version == "00" and more):
        return None
    trace_id, span_id = int(trace, 16), int(span_id, 16)
    if not trace_id or not span_id:
        return None
    state = _trace_state(headers.get("tracestate"))
    return Caller(trace_id, span_id, bool(int(flags, 16) & 1), state)


def _trace_state(value: str | None) -> str:
    """A `tracestate` header as it is passed on: its members, or "" if it is not one."""
    if not value:
        return ""
    members = [m.strip() for m in value.split(",") if m.strip()]
    if len(members) > _TRACESTATE_MEMBERS or not all(m.find("=") > 0 for m in members):
        return ""
    return ",".join(members)


def start(name: str, kind: int, caller: Caller | None = None, attributes=None, start_ns=0):
    """A span for work begun now (or at `start_ns`, time.time_ns()): a `Span` if it is
    sampled, an `Unsampled` that names it and records nothing if not. With no `caller`
    it is a root, sampled by its trace id; with one, sampled as the caller's was."""
    if caller is None:
        trace_id = _getrandbits(128) or 1
        if trace_id & _LOW64 >= _bound:
            return Unsampled(trace_id, _getrandbits(64) or 1, "")
        return Span(name, trace_id, 0, kind, attributes, "", False, start_ns)
    if not caller.sampled:  # the engine hears of the caller's span: we made none
        return Unsampled(caller.trace_id, caller.span_id, caller.trace_state)
    return Span(name, caller.trace_id, caller.span_id, kind, attributes, caller.trace_state,
                True, start_ns)  # fmt: skip


def child(parent: "Span", name: str, kind: int = INTERNAL, attributes=None) -> "Span":
    """A span under `parent` (a sampled one: an unsampled span has no children)."""
    return Span(name, parent.trace_id, parent.span_id, kind, attributes, parent.trace_state)


def traceparent(span) -> str:
    """The W3C `traceparent` naming `span` as the parent of what the callee does."""
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"


def done(name: str, began_ns: int, attributes: dict) -> None:
    """A span for work that has just ended (begun at `began_ns`, time.time_ns()), made
    only once it is known to be worth one."""
    if tracer is None:
        return
    start(name, INTERNAL, None, attributes, began_ns).end()


class Span:
    """A sampled span, as plainly as it can be kept: what otlp.py writes, and the calls
    OpenTelemetry's spans take that llmgw makes. It goes to the export queue when it
    ends; what is set on it after is ignored (the exporter's thread may be writing it)."""

    __slots__ = ("name", "trace_id", "span_id", "parent_id", "kind", "start_ns", "end_ns",
                 "attributes", "events", "status", "status_message", "trace_state",
                 "remote")  # fmt: skip
    trace_flags = 1  # sampled: an unsampled span is an Unsampled

    def __init__(self, name: str, trace_id: int, parent_id: int, kind: int, attributes=None,
                 trace_state: str = "", remote: bool = False, start_ns: int = 0):  # fmt: skip
        self.name, self.trace_id, self.parent_id, self.kind = name, trace_id, parent_id, kind
        self.span_id = _getrandbits(64) or 1
        self.start_ns = start_ns or time_ns()
        self.end_ns = 0
        self.attributes = attributes if attributes is not None else {}  # taken, not copied
        self.events = None
        self.status, self.status_message = otlp.UNSET, ""
        self.trace_state, self.remote = trace_state, remote

    def get_span_context(self):
        return self

    def is_recording(self) -> bool:
        return not self.end_ns

    def set_attribute(self, key: str, value) -> None:
        if not self.end_ns:
            self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        if not self.end_ns:
            self.attributes.update(attributes)

    def update_name(self, name: str) -> None:
        if not self.end_ns:
            self.name = name

    def set_status(self, code: int, description: str | None = None) -> None:
        """`ERROR` (with why) or `OK`: OTLP's status codes."""
        if not self.end_ns:
            self.status = code
            self.status_message = (description or "") if code == ERROR else ""

    def add_event(self, name: str, attributes=None, timestamp: int | None = None) -> None:
        if self.end_ns:
            return
        if self.events is None:
            self.events = []
        self.events.append((timestamp or time_ns(), name, attributes))

    def record_exception(self, exception: BaseException) -> None:
        """An `exception` event, as OpenTelemetry's conventions write one."""
        self.add_event("exception", {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
        })  # fmt: skip

    def end(self, end_time: int | None = None) -> None:
        if self.end_ns:
            return
        self.end_ns = end_time or time_ns()
        queue = tracer
        if queue is not None:
            queue.put(self)


class Unsampled:
    """A span the sampler left out: its ids go on to the engine (flags 00, so it leaves
    the request out too), and nothing is recorded or exported."""

    __slots__ = ("trace_id", "span_id", "trace_state")
    trace_flags = 0

    def __init__(self, trace_id: int, span_id: int, trace_state: str):
        self.trace_id, self.span_id, self.trace_state = trace_id, span_id, trace_state

    def get_span_context(self):
        return self

    def is_recording(self) -> bool:
        return False

    def end(self, end_time=None) -> None:
        pass


class _Off:
    """What `span()` yields while tracing is off (or a span is not sampled): takes every
    call a span takes, and keeps nothing."""

    __slots__ = ()

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def update_name(self, name) -> None:
        pass

    def add_event(self, name, attributes=None, timestamp=None) -> None:
        pass

    def set_status(self, status, description=None) -> None:
        pass

    def record_exception(self, exception) -> None:
        pass

    def is_recording(self) -> bool:
        return False


OFF = _Off()


@contextlib.contextmanager
def span(name: str, headers=None, server: bool = False):
    """A span around the block; `OFF` while tracing is off or the span is not sampled.
    `headers`: a request's, whose `traceparent` is its parent; `server`: it serves a
    request (SpanKind.SERVER). An exception that leaves the block is recorded on it and
    sets its status to ERROR, as the SDK's spans did."""
    if tracer is None:
        yield OFF
        return
    caller = parent(headers) if headers is not None else None
    s = start(name, SERVER if server else INTERNAL, caller)
    if s.__class__ is Unsampled:
        yield OFF
        return
    try:
        yield s
    except Exception as e:
        s.record_exception(e)
        s.set_status(ERROR, f"{type(e).__name__}: {e}")
        raise
    finally:
        s.end()
