"""Where ended spans wait for the collector: a bounded queue, and one thread that takes
them from it every second (or as soon as a batch is full), writes them as one OTLP
request (otlp.py) and sends it with the OpenTelemetry SDK's OTLP/gRPC exporter (its
channel, TLS and headers from `OTEL_EXPORTER_OTLP_*`, its retries and back-off).

A span that finds `size` waiting is dropped and counted, and a batch the collector does
not take is counted too, so a dead or slow collector costs counters and one log line,
never a request's time.
"""

import collections
import logging
import threading

from prometheus_client import Counter

from llmgw import log

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
_QUEUE_FULL = SPANS_DROPPED.labels("queue_full")
_EXPORT_FAILED = SPANS_DROPPED.labels("export_failed")

BATCH = 512  # spans in one export request at most
# Batches go every second (the SDK's default is 5 s): a trace is in the collector by the
# time someone looks for the request they just made.
DELAY_S = 1.0
# The longest one export to the collector may take, retries included: the exporter's
# thread is all it holds up, but a process that stops waits for it (up to `shutdown`'s).
EXPORT_TIMEOUT_S = 5.0
# Where the OTLP exporter logs each failed try: taken over (one line when exports start
# failing and one when they recover, not one per batch).
_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"
_EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Batch:
    """An export request already encoded, and how many spans it carries."""

    __slots__ = ("data", "n")

    def __init__(self, data: bytes, n: int):
        self.data, self.n = data, n


def grpc_exporter(endpoint: str):
    """The SDK's OTLP/gRPC span exporter, sending `Batch`es: it is handed the request's
    bytes rather than SDK spans, and its stub sends them as they are. Two of its
    internals are relied on (`_translate_data`, the hook its own subclass fills, and
    `_initialize_channel_and_stub` setting `_client`); tests/unit/test_traces.py sends
    through it to a real receiver, so a release that changes them fails there."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class Encoded(OTLPSpanExporter):
        def _initialize_channel_and_stub(self):  # at start, and again to reconnect
            super()._initialize_channel_and_stub()
            self._client = _BytesStub(self._channel)

        def _translate_data(self, data: Batch) -> bytes:
            return data.data

        def _count_data(self, data: Batch) -> int:
            return data.n

    return Encoded(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)


class _BytesStub:
    """The TraceService stub, but the request is its serialized bytes already."""

    def __init__(self, channel):
        self.Export = channel.unary_unary(_EXPORT_METHOD)  # no serializer: bytes go as they are


class SpanQueue:
    """Ended spans, waiting for the exporter's thread (`start` it). `encode` turns a list
    of spans into an export request's bytes; `exporter` sends a `Batch` and says whether
    the collector took it (the SDK's SpanExportResult)."""

    def __init__(self, encode, exporter, size: int, endpoint: str):
        self.encode, self.exporter, self.size = encode, exporter, size
        self.endpoint = endpoint
        self.spans = collections.deque()
        self.wake = threading.Condition(threading.Lock())
        self.stopping = False
        self.failing = False
        self.said = _Said()
        logging.getLogger(_EXPORTER_LOGGER).filters.insert(0, self.said)
        self.thread = threading.Thread(target=self._run, name="tracing-export", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, span) -> None:
        """Queue an ended span, or drop and count it if the queue is full. The request
        path's one call here: no lock (deque's append and len are atomic), so two
        threads at once may pass the bound by one span each."""
        spans = self.spans
        if len(spans) >= self.size:
            _QUEUE_FULL.inc()
            return
        spans.append(span)
        if len(spans) == BATCH:
            with self.wake:
                self.wake.notify()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Export what waits, for at most `timeout_s`; then stop the exporter's retries."""
        with self.wake:
            self.stopping = True
            self.wake.notify()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.exporter.shutdown()
        logging.getLogger(_EXPORTER_LOGGER).removeFilter(self.said)

    def _run(self) -> None:
        while True:
            with self.wake:
                if not self.stopping and len(self.spans) < BATCH:
                    self.wake.wait(DELAY_S)
                stopping = self.stopping
            # What waits now, and no more: spans that end while it is sent wait for the
            # next round (sending until the queue is empty sent a batch of a few spans
            # every half millisecond under load, at ~0.4 ms of CPU each).
            waiting = len(self.spans)
            while waiting > 0:
                waiting -= self.export_one(min(BATCH, waiting))
            if stopping:
                return

    def export_one(self, n: int) -> int:
        """Send the `n` spans that waited longest (there are that many), counting what
        came of it; `n`."""
        take = self.spans.popleft
        spans = [take() for _ in range(n)]
        try:
            ok = self.exporter.export(Batch(self.encode(spans), n)).name == "SUCCESS"
        except Exception as e:  # noqa: BLE001 - an exporter's bug must not stop the thread
            self.said.last = f"{type(e).__name__}: {e}"
            ok = False
        if ok:
            SPANS_EXPORTED.inc(n)
            if self.failing:
                self.failing = False
                _log.info("tracing_export_recovered", endpoint=self.endpoint)
            return n
        EXPORT_FAILURES.inc()
        _EXPORT_FAILED.inc(n)
        if not self.failing:
            self.failing = True
            _log.warning(
                "tracing_export_failed",
                endpoint=self.endpoint,
                spans=n,
                reason=self.said.last[:300] or None,
                action="spans are dropped and counted until the collector answers",
            )
        return n


class _Said(logging.Filter):
    """Keeps the OTLP exporter's last line, and keeps it out of the log."""

    def __init__(self):
        super().__init__()
        self.last = ""

    def filter(self, record) -> bool:
        self.last = record.getMessage()
        return False
