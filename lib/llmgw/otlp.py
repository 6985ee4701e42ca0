"""Spans as OTLP protobuf bytes: an `ExportTraceServiceRequest` written directly in
protobuf's wire format (varints, fixed-width numbers, length-prefixed fields), from the
plain span records `llmgw.tracing` keeps.

Why by hand: the SDK builds a span object for every span, then an opentelemetry-proto
message for it, then serializes that; on the router that was ~50 µs a span on the
exporter's thread alone (bench/TRACING.md). Writing the bytes once costs a few. Pure:
bytes in, bytes out; tests decode what it writes with opentelemetry-proto's own classes.

A span record has `name`, `trace_id` and `span_id` (ints), `parent_id` (0 for a root),
`remote` (the parent came from a caller's `traceparent`), `kind` (OTLP's numbers:
`INTERNAL`…), `start_ns`, `end_ns`, `attributes` (a dict), `events` (None or a list of
(time_ns, name, attributes)), `status` (0 unset, 1 ok, 2 error), `status_message` and
`trace_state` (the header's text).
"""

import struct

# SpanKind, as OTLP numbers it.
INTERNAL, SERVER, CLIENT, PRODUCER, CONSUMER = 1, 2, 3, 4, 5
# Status codes.
UNSET, OK, ERROR = 0, 1, 2

# Span.flags: bit 8 says whether bit 9 is known, bit 9 that the parent is remote (what the
# SDK's encoder writes for every span).
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_LOW64 = (1 << 64) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_pack_fixed64 = struct.Struct("<Q").pack
_pack_double = struct.Struct("<d").pack
_pack_fixed32 = struct.Struct("<I").pack
_SMALL = [bytes((n,)) for n in range(128)]


def varint(n: int) -> bytes:
    """`n` (0 or more, below 2**64) as a protobuf varint."""
    if n < 128:
        return _SMALL[n]
    out = bytearray()
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: int, data: bytes) -> bytes:
    """A length-delimited field: its tag (one byte: every field this module writes this
    way is numbered below 16), the length, the bytes."""
    n = len(data)
    if n < 128:  # most: one byte of length
        return bytes((tag, n)) + data
    return b"".join((_SMALL[tag], varint(n), data))


def _tag(number: int, wire: int) -> int:
    return (number << 3) | wire


# Tags, as the first byte(s) of each field (wire types: 0 varint, 1 fixed64, 2 bytes,
# 5 fixed32), from opentelemetry-proto's trace.proto, common.proto and resource.proto.
_KV_KEY, _KV_VALUE = _tag(1, 2), _tag(2, 2)
_ANY_STRING, _ANY_BOOL, _ANY_INT = _tag(1, 2), _tag(2, 0), _tag(3, 0)
_ANY_DOUBLE, _ANY_ARRAY, _ANY_BYTES = _tag(4, 1), _tag(5, 2), _tag(7, 2)
_ARRAY_VALUE = _tag(1, 2)
_SPAN_NAME, _SPAN_TRACE_STATE = _tag(5, 2), _tag(3, 2)
_SPAN_IDS = bytes((_tag(1, 2), 16))  # trace_id: 16 bytes
_SPAN_ID = bytes((_tag(2, 2), 8))  # span_id: 8 bytes
_SPAN_PARENT = bytes((_tag(4, 2), 8))  # parent_span_id: 8 bytes
_SPAN_KIND = bytes((_tag(6, 0),))
_SPAN_START, _SPAN_END = bytes((_tag(7, 1),)), bytes((_tag(8, 1),))
_SPAN_ATTRIBUTE, _SPAN_EVENT, _SPAN_STATUS = _tag(9, 2), _tag(11, 2), _tag(15, 2)
_SPAN_FLAGS = varint(_tag(16, 5))
_EVENT_TIME, _EVENT_NAME, _EVENT_ATTRIBUTE = bytes((_tag(1, 1),)), _tag(2, 2), _tag(3, 2)
_STATUS_MESSAGE, _STATUS_CODE = _tag(2, 2), bytes((_tag(3, 0),))
_SCOPE_NAME, _SCOPE_VERSION = _tag(1, 2), _tag(2, 2)
_SCOPE_SPANS_SCOPE, _SCOPE_SPANS_SPAN = _tag(1, 2), _tag(2, 2)
_RESOURCE_ATTRIBUTE = _tag(1, 2)
_RESOURCE_SPANS_RESOURCE, _RESOURCE_SPANS_SCOPE_SPANS = _tag(1, 2), _tag(2, 2)
_REQUEST_RESOURCE_SPANS = _tag(1, 2)
_FLAGS = {False: _SPAN_FLAGS + _pack_fixed32(_HAS_IS_REMOTE),
          True: _SPAN_FLAGS + _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE)}  # fmt: skip


def any_value(v) -> bytes | None:
    """An AnyValue's bytes, or None for a value OTLP has no type for (the SDK drops
    such attributes too). bool before int: True is an int to Python."""
    t = type(v)
    if t is str:
        return field(_ANY_STRING, v.encode())
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int:
        if not _INT64_MIN <= v <= _INT64_MAX:
            return field(_ANY_STRING, str(v).encode())  # beyond int64: its digits
        return _SMALL[_ANY_INT] + varint(v & _LOW64)
    if t is float:
        return _SMALL[_ANY_DOUBLE] + _pack_double(v)
    if t is list or t is tuple:
        values = [x for x in map(any_value, v) if x is not None]
        return field(_ANY_ARRAY, b"".join(field(_ARRAY_VALUE, x) for x in values))
    if t is bytes:
        return field(_ANY_BYTES, v)
    if isinstance(v, str | bool | int | float | bytes | list | tuple):  # a subclass
        return any_value(_plain(v))
    return None


def _plain(v):
    """A subclass's value as its base type's (a StrEnum's text, an IntEnum's number)."""
    if isinstance(v, str):
        return str.__str__(v)
    for t in (bool, int, float, bytes, list, tuple):
        if isinstance(v, t):
            return t(v)
    return None


_keys: dict[str, bytes] = {}  # a KeyValue's key field, by key: the few keys code sets


def key_values(tag: int, attributes: dict) -> bytes:
    """Each attribute as a KeyValue field numbered `tag`."""
    out = []
    for k, v in attributes.items():
        value = any_value(v)
        if value is None:
            continue
        key = _keys.get(k)
        if key is None:
            key = field(_KV_KEY, k.encode())
            if len(_keys) < 1024:
                _keys[k] = key
        out.append(field(tag, key + field(_KV_VALUE, value)))
    return b"".join(out)


def span(s) -> bytes:
    """One Span message's bytes (without its own tag and length)."""
    parts = [_SPAN_IDS, s.trace_id.to_bytes(16, "big"), _SPAN_ID, s.span_id.to_bytes(8, "big")]
    if s.trace_state:
        parts.append(field(_SPAN_TRACE_STATE, s.trace_state.encode()))
    if s.parent_id:
        parts += (_SPAN_PARENT, s.parent_id.to_bytes(8, "big"))
    parts += (
        field(_SPAN_NAME, s.name.encode()),
        _SPAN_KIND,
        _SMALL[s.kind],
        _SPAN_START,
        _pack_fixed64(s.start_ns),
        _SPAN_END,
        _pack_fixed64(s.end_ns),
        key_values(_SPAN_ATTRIBUTE, s.attributes),
    )
    for time_ns, name, attributes in s.events or ():
        event = b"".join((_EVENT_TIME, _pack_fixed64(time_ns), field(_EVENT_NAME, name.encode()),
                          key_values(_EVENT_ATTRIBUTE, attributes or {})))  # fmt: skip
        parts.append(field(_SPAN_EVENT, event))
    status = field(_STATUS_MESSAGE, s.status_message.encode()) if s.status_message else b""
    if s.status:
        status += _STATUS_CODE + _SMALL[s.status]
    parts += (field(_SPAN_STATUS, status), _FLAGS[s.remote])
    return b"".join(parts)


class Encoder:
    """ExportTraceServiceRequests for one process: its resource's attributes and its
    instrumentation scope (name, version) written once, each batch's spans under them."""

    def __init__(self, resource: dict, scope: str, version: str):
        self.resource = field(_RESOURCE_SPANS_RESOURCE, key_values(_RESOURCE_ATTRIBUTE, resource))
        self.scope = field(
            _SCOPE_SPANS_SCOPE,
            field(_SCOPE_NAME, scope.encode()) + field(_SCOPE_VERSION, version.encode()),
        )

    def request(self, spans) -> bytes:
        """An ExportTraceServiceRequest's bytes carrying `spans`."""
        body = b"".join([self.scope] + [field(_SCOPE_SPANS_SPAN, span(s)) for s in spans])
        resource_spans = self.resource + field(_RESOURCE_SPANS_SCOPE_SPANS, body)
        return field(_REQUEST_RESOURCE_SPANS, resource_spans)
