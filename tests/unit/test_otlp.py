"""llmgw.otlp writes OTLP export requests by hand: what it writes, decoded by
opentelemetry-proto's own classes, says what the spans said."""

import enum

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from llmgw import otlp
from llmgw.tracing import Span
from tests.otlp_receiver import value_of

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT = 0x00F067AA0BA902B7


def ended(span: Span, end_ns: int = 0) -> Span:
    span.end_ns = end_ns or span.start_ns + 1_500_000
    return span


def decoded(spans, resource=None) -> ExportTraceServiceRequest:
    encoder = otlp.Encoder(resource or {"service.name": "llmgw-router"}, "llmgw", "0.9.1")
    request = ExportTraceServiceRequest()
    request.ParseFromString(encoder.request(spans))
    return request


def attributes(kvs) -> dict:
    return {kv.key: value_of(kv.value) for kv in kvs}


def only_span(request) -> PbSpan:
    (rs,) = request.resource_spans
    (ss,) = rs.scope_spans
    (s,) = ss.spans
    return s


def test_a_span_decodes_to_its_ids_name_kind_times_and_parent():
    s = ended(Span("chat m", TRACE, PARENT, otlp.SERVER, {}, "", True, 1_700_000_000_123_456_789))
    got = only_span(decoded([s]))
    assert got.trace_id.hex() == f"{TRACE:032x}"
    assert got.span_id == s.span_id.to_bytes(8, "big")
    assert got.parent_span_id.hex() == f"{PARENT:016x}"
    assert (got.name, got.kind) == ("chat m", PbSpan.SPAN_KIND_SERVER)
    assert got.start_time_unix_nano == 1_700_000_000_123_456_789
    assert got.end_time_unix_nano == s.end_ns
    assert got.flags == 0x300, "the SDK's flags: whether the parent is remote is known, and it is"
    assert got.HasField("status") and got.status.code == Status.STATUS_CODE_UNSET


def test_a_root_has_no_parent_and_a_local_parent_is_not_remote():
    root = only_span(decoded([ended(Span("llmgw.placement_pass", TRACE, 0, otlp.INTERNAL))]))
    assert (root.parent_span_id, root.kind, root.flags) == (b"", PbSpan.SPAN_KIND_INTERNAL, 0x100)
    child = only_span(decoded([ended(Span("llmgw.attempt", TRACE, PARENT, otlp.CLIENT))]))
    assert (child.parent_span_id.hex(), child.flags) == (f"{PARENT:016x}", 0x100)


def test_every_attribute_type_decodes_to_its_value():
    class Band(enum.StrEnum):
        GOLD = "gold"

    attrs = {
        "text": "héllo ✓",
        "empty": "",
        "yes": True,
        "no": False,
        "zero": 0,
        "big": 2**62 + 5,
        "negative": -42,
        "beyond_int64": 2**70,
        "ratio": 0.125,
        "list": ["m@node-a", "n@node-b"],
        "ints": (1, 2, 300),
        "empty_list": [],
        "raw": b"\x00\xff",
        "band": Band.GOLD,
        "dropped": None,
        "also_dropped": object(),
    }
    got = attributes(
        only_span(decoded([ended(Span("x", TRACE, 0, otlp.INTERNAL, attrs))])).attributes
    )
    assert got == {
        "text": "héllo ✓",
        "empty": "",
        "yes": True,
        "no": False,
        "zero": 0,
        "big": 2**62 + 5,
        "negative": -42,
        "beyond_int64": str(2**70),
        "ratio": 0.125,
        "list": ["m@node-a", "n@node-b"],
        "ints": [1, 2, 300],
        "empty_list": [],
        "raw": b"\x00\xff",
        "band": "gold",
    }


def test_events_status_and_trace_state_decode_as_set():
    s = Span("GET /v1/replicas", TRACE, PARENT, otlp.SERVER, {"a": 1}, "vendor=x,other=y", True)
    s.add_event("exception", {"exception.type": "KeyError", "exception.message": "'m'"}, 7)
    s.add_event("retry", None, 9)
    s.set_status(otlp.ERROR, "KeyError: 'm'")
    got = only_span(decoded([ended(s)]))
    assert got.trace_state == "vendor=x,other=y"
    events = [(e.time_unix_nano, e.name, attributes(e.attributes)) for e in got.events]
    assert events == [
        (7, "exception", {"exception.type": "KeyError", "exception.message": "'m'"}),
        (9, "retry", {}),
    ]
    assert (got.status.code, got.status.message) == (Status.STATUS_CODE_ERROR, "KeyError: 'm'")


def test_a_batch_is_one_resource_and_one_scope_with_every_span_in_order():
    spans = [ended(Span(f"s{i}", TRACE, 0, otlp.INTERNAL, {"i": i})) for i in range(300)]
    resource = {"service.name": "llmgw-router", "service.namespace": "llmgw",
                "telemetry.sdk.language": "python"}  # fmt: skip
    request = decoded(spans, resource)
    (rs,) = request.resource_spans
    assert attributes(rs.resource.attributes) == resource
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("llmgw", "0.9.1")
    assert [(s.name, attributes(s.attributes)["i"]) for s in ss.spans] == [
        (f"s{i}", i) for i in range(300)
    ]


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 2**35, 2**64 - 1])
def test_a_varint_reads_back_as_the_number(n):
    from google.protobuf.internal.decoder import _DecodeVarint

    data = otlp.varint(n)
    assert _DecodeVarint(data, 0) == (n, len(data))
