"""OpenTelemetry traces, off unless `[tracing] endpoint` is set.

While it is off, `tracer` is None and nothing of OpenTelemetry is imported or made:
the router checks `tracer is None` once a request, and `span()` hands out one shared
no-op. Once `setup()` has run, spans go through a bounded queue to one exporter thread
(OTLP over gRPC): a span that finds the queue full is dropped and counted, and a batch
the collector does not take is counted too, so a dead or slow collector costs counters
and one log line, never a request's time.

The sampler is parent-based: a request whose `traceparent` says its caller traced it
is traced, one whose caller did not is not, and the rest are traced at `sample_rate`
by their trace id (so the router, the scheduler and vLLM agree on a trace).
"""

import contextlib
import logging
import os
import random
import socket
import threading

from prometheus_client import Counter

from llmgw import __version__, log
from llmgw.errors import ConfigError

_log = log.get("llmgw.tracing")

SPANS_DROPPED = Counter(
    "llmgw_tracing_spans_dropped_total",
    "Spans not delivered to the collector: queue_full (the exporter is behind) or"
    " export_failed (the collector did not take them)",
    ["reason"],
)
SPANS_EXPORTED = Counter("llmgw_tracing_spans_exported_total", "Spans the collector took")
EXPORT_FAILURES = Counter(
    "llmgw_tracing_export_failures_total", "Batches of spans the collector did not take"
)

# The tracer while tracing is on; None while it is off (the request path checks this).
tracer = None
_processor = None
_propagator = None
_ids = None  # the provider's id generator (_Ids)
_bound = 0  # a root whose trace id's low 64 bits are below this is sampled
_LOW64 = (1 << 64) - 1
_NO_PARENT = None  # an empty Context: a root's, whatever is current

# The longest one export to the collector may take, retries included: the exporter's
# thread is all it holds up, but a router that stops waits for it (up to `shutdown`'s).
EXPORT_TIMEOUT_S = 5.0
# Where the OTLP exporter logs each failed try: taken over (one line when exports start
# failing and one when they recover, not one per batch).
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


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


def setup(cfg, service: str, exporter=None) -> bool:
    """Start tracing as `cfg` ([tracing]) says, as `service`; whether it is on.
    `exporter`: a test's, instead of OTLP to cfg.endpoint."""
    global tracer, _processor, _propagator, _ids, _bound, _NO_PARENT
    check(cfg)
    if not cfg.endpoint and exporter is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, timeout=EXPORT_TIMEOUT_S)
    resource = Resource.create(
        {
            "service.name": cfg.service_name or service,
            "service.namespace": "llmgw",
            "service.version": __version__,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        }
    )
    sampler = TraceIdRatioBased(cfg.sample_rate)
    _bound = sampler.bound
    _ids = _Ids()
    provider = TracerProvider(resource=resource, sampler=ParentBased(sampler), id_generator=_ids)
    _processor = Queue(exporter, cfg.queue_size, cfg.endpoint)
    provider.add_span_processor(_processor)
    _propagator = TraceContextTextMapPropagator()
    from opentelemetry.context import Context

    _NO_PARENT = Context()
    tracer = provider.get_tracer("llmgw", __version__)
    _log.info("tracing", endpoint=cfg.endpoint or "test", sample_rate=cfg.sample_rate,
              service=cfg.service_name or service)  # fmt: skip
    return True


def shutdown(timeout_s: float = 2.0) -> None:
    """Send what is queued, waiting at most `timeout_s` (a dead collector is not waited
    for longer), and stop; tracing is off after."""
    global tracer, _processor
    processor, _processor, tracer = _processor, None, None
    if processor is not None:
        processor.shutdown(timeout_s)


def root(name: str, kind):
    """A span with no parent: the SDK's if the sampler takes its trace id, else an
    `Unsampled` that names it and records nothing. The sampler's rule applied here
    first (the SDK's TraceIdRatioBased: the trace id's low 64 bits under the bound),
    because the SDK makes a span object, ids and a context for every request the
    sampler leaves out, ~6 µs each (bench/TRACING.md)."""
    trace_id = random.getrandbits(128) or 1
    if trace_id & _LOW64 >= _bound:
        return Unsampled(trace_id, random.getrandbits(64) or 1)
    _ids.next.trace_id = trace_id  # the SDK's span takes this id, and samples it alike
    return tracer.start_span(name, context=_NO_PARENT, kind=kind)


def parent(headers):
    """The trace context a caller's `traceparent` (and `tracestate`) carry, or None for
    none: the request's span is made its child."""
    if _propagator is None or headers.get("traceparent") is None:
        return None
    return _propagator.extract(headers)


def context_of(span):
    """A Context whose current span is `span`: what a child is started in."""
    from opentelemetry.trace import set_span_in_context

    return set_span_in_context(span)


def traceparent(span) -> str:
    """The W3C `traceparent` naming `span` as the parent of what the callee does."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def done(name: str, began_ns: int, attributes: dict) -> None:
    """A span for work that has just ended (begun at `began_ns`, time.time_ns()), made
    only once it is known to be worth one."""
    if tracer is None:
        return
    s = tracer.start_span(name, start_time=began_ns, attributes=attributes)
    s.end()


class Unsampled:
    """A root the sampler left out: its ids go on to the engine (flags 00, so it leaves
    the request out too), and nothing is recorded or exported."""

    __slots__ = ("trace_id", "span_id")
    trace_flags = 0
    trace_state = None

    def __init__(self, trace_id: int, span_id: int):
        self.trace_id, self.span_id = trace_id, span_id

    def get_span_context(self):
        return self

    def is_recording(self) -> bool:
        return False

    def end(self, end_time=None) -> None:
        pass


class _Ids:
    """The SDK's random ids, but a root's trace id is the one `root` drew, when it set
    one (per thread: the scheduler starts spans on several)."""

    def __init__(self):
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self.random = RandomIdGenerator()
        self.next = threading.local()
        self.generate_span_id = self.random.generate_span_id

    def is_trace_id_random(self) -> bool:  # W3C's "random" flag: they are
        return True

    def generate_trace_id(self) -> int:
        drawn = getattr(self.next, "trace_id", 0)
        if drawn:
            self.next.trace_id = 0
            return drawn
        return self.random.generate_trace_id()


class _Off:
    """What `span()` yields while tracing is off (or a span is not sampled): takes every
    call a span takes, and keeps nothing."""

    __slots__ = ()

    def set_attribute(self, key, value) -> None:
        pass

    def set_attributes(self, attributes) -> None:
        pass

    def add_event(self, name, attributes=None) -> None:
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
    """A span around the block, made current (threads' code: the scheduler); `OFF`
    while tracing is off. `headers`: a request's, whose `traceparent` is its parent;
    `server`: it serves a request (SpanKind.SERVER)."""
    if tracer is None:
        yield OFF
        return
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    ctx = parent(headers) if headers is not None else None
    with tracer.start_as_current_span(name, context=ctx, kind=kind) as s:
        yield s


class Queue:
    """A span processor: each sampled span that ends goes to the batch processor's
    queue, unless `size` are waiting already (then it is dropped and counted); the
    exporter's results are counted. Counting here rather than reading the SDK's queue:
    its own count of drops is a log line."""

    def __init__(self, exporter, size: int, endpoint: str):
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.size = size
        self.waiting = 0
        self.lock = threading.Lock()
        self.counted = _Counted(exporter, self, endpoint)
        # Batches go every second (the SDK's default is 5 s): a trace is in the collector
        # by the time someone looks for the request they just made.
        self.batch = BatchSpanProcessor(
            self.counted,
            max_queue_size=size,
            max_export_batch_size=min(512, size),
            schedule_delay_millis=1000,
        )

    def on_start(self, span, parent_context=None) -> None:
        pass

    def _on_ending(self, span) -> None:  # the SDK's SpanProcessor has it: called first
        pass

    def on_end(self, span) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self.lock:
            full = self.waiting >= self.size
            if not full:
                self.waiting += 1
        if full:
            SPANS_DROPPED.labels("queue_full").inc()
            return
        self.batch.on_end(span)

    def taken(self, n: int) -> None:
        """`n` spans left the queue for the exporter."""
        with self.lock:
            self.waiting -= n

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what waits, for at most `timeout_s`; then stop the exporter's retries
        (the batch processor itself would wait for them up to 30 s)."""
        last = threading.Thread(target=self.batch.shutdown, name="tracing-flush", daemon=True)
        last.start()
        last.join(timeout_s)
        self.counted.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


class _Counted:
    """The exporter, counted: spans exported, batches failed (their spans dropped), and
    one log line when exports begin to fail and one when they recover. The OTLP
    exporter's own line for each failed try is kept back; its last says why."""

    def __init__(self, exporter, queue: Queue, endpoint: str):
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.exporter, self.queue, self.endpoint = exporter, queue, endpoint
        self.success = SpanExportResult.SUCCESS
        self.failure = SpanExportResult.FAILURE
        self.failing = False
        self.stopped = False
        self.said = _Said()
        logger = logging.getLogger(_EXPORTER_LOGGER)
        logger.filters.insert(0, self.said)

    def export(self, spans):
        n = len(spans)
        self.queue.taken(n)
        try:
            result = self.exporter.export(spans)
        except Exception as e:  # noqa: BLE001 - an exporter's bug must not stop the thread
            self.said.last = f"{type(e).__name__}: {e}"
            result = self.failure
        if result == self.success:
            SPANS_EXPORTED.inc(n)
            if self.failing:
                self.failing = False
                _log.info("tracing_export_recovered", endpoint=self.endpoint)
            return result
        EXPORT_FAILURES.inc()
        SPANS_DROPPED.labels("export_failed").inc(n)
        if not self.failing:
            self.failing = True
            _log.warning(
                "tracing_export_failed",
                endpoint=self.endpoint,
                spans=n,
                reason=self.said.last[:300] or None,
                action="spans are dropped and counted until the collector answers",
            )
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.exporter.shutdown()
        logging.getLogger(_EXPORTER_LOGGER).removeFilter(self.said)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class _Said(logging.Filter):
    """Keeps the OTLP exporter's last line, and keeps it out of the log."""

    def __init__(self):
        super().__init__()
        self.last = ""

    def filter(self, record) -> bool:
        self.last = record.getMessage()
        return False
