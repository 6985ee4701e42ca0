"""A real OTLP/gRPC trace receiver for the tests: the TraceService Export RPC of
opentelemetry-proto on a grpcio server, on a loopback port chosen at run time. It keeps
every request as it came and every span read from them, plainly (ids as hex, attributes
as a dict), for tests to look at what a collector would have been sent."""

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.helpers import eventually, free_port

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def value_of(v):
    """An OTLP AnyValue as Python."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: str
    start_ns: int
    end_ns: int
    attributes: dict
    events: list  # [(name, attributes)]
    status: int  # 0 unset, 1 ok, 2 error
    service: str  # the resource's service.name
    resource: dict = field(repr=False, default_factory=dict)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.requests: list = []  # ExportTraceServiceRequest, as received
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the RPC's name
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: value_of(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=KINDS.get(s.kind, str(s.kind)),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: value_of(kv.value) for kv in s.attributes},
                            events=[
                                (e.name, {kv.key: value_of(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                            status=s.status.code,
                            service=str(resource.get("service.name", "")),
                            resource=resource,
                        )
                    )
        with self.lock:
            self.requests.append(request)
            self.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    # -- looking -------------------------------------------------------------------------

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.name == name]

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, cond, timeout: float = 15.0, what: str = "spans"):
        """Wait until `cond(self)` holds (exporters batch: spans come a second or so late)."""
        return eventually(lambda: cond(self), timeout=timeout, what=what)

    def as_json(self, trace_id: str) -> dict:
        """One trace's spans as OTLP/JSON (the protobuf's JSON mapping), as received:
        one resourceSpans entry per export request that carried any of them."""
        out = []
        with self.lock:
            for request in self.requests:
                for rs in request.resource_spans:
                    scopes = []
                    for ss in rs.scope_spans:
                        mine = [s for s in ss.spans if s.trace_id.hex() == trace_id]
                        if mine:
                            d = MessageToDict(ss)
                            d["spans"] = [span_json(s) for s in mine]
                            scopes.append(d)
                    if scopes:
                        out.append({"resource": MessageToDict(rs.resource), "scopeSpans": scopes})
        return {"resourceSpans": out}

    def stop(self) -> None:
        self.server.stop(grace=None)


def span_json(s) -> dict:
    """A span in OTLP/JSON: the protobuf's JSON mapping, but ids in hex as OTLP/JSON has
    them (the mapping would write bytes in base64)."""
    d = MessageToDict(s)
    for key, raw in (("traceId", s.trace_id), ("spanId", s.span_id),
                     ("parentSpanId", s.parent_span_id)):  # fmt: skip
        if raw:
            d[key] = raw.hex()
    return d
