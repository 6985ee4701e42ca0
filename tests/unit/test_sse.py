"""The router's one SSE codec (sse.py) and the stream readers on it (meter.py): every
framing of the same events reads as the same events, however the bytes are cut, and no
text a model writes ends a stream or says its usage."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_router import anthropic, responses, sse
from llmgw_router.meter import (
    Meter,
    NativeStream,
    OpenAIStream,
)

ENDS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}

# Field values hold no line ends (a line end ends the field); anything else goes.
values = st.text(alphabet=st.sampled_from(' :ab\t{}"[]é\x00DONE'), max_size=8)
events_ = st.lists(
    st.tuples(
        st.sampled_from(["", "message_stop", "response.completed", "x"]),  # its name
        st.lists(values, min_size=1, max_size=3),  # its data lines
        st.one_of(st.none(), values),  # its id
    ),
    min_size=1,
    max_size=5,
)


def framed(events, end: bytes, spaced: list[bool], comments: bool, blanks: int) -> bytes:
    """`events` written with line ends `end`, a space after each colon where `spaced`
    says (always before a value that starts with one), comments and extra blank lines."""
    out, k = [], 0

    def line(field: str, value: str) -> bytes:
        nonlocal k
        space = spaced[k % len(spaced)] or value.startswith(" ")
        k += 1
        return field.encode() + (b": " if space else b":") + value.encode() + end

    for name, data, ident in events:
        if comments:
            out.append(b": a comment" + end)
        if name:
            out.append(line("event", name))
        out += [line("data", d) for d in data]
        if ident is not None:
            out.append(line("id", ident))
        out.append(end * (1 + blanks))
    return b"".join(out)


def cut(data: bytes, at: list[int]) -> list[bytes]:
    points = sorted({min(a, len(data)) for a in at})
    return [data[i:j] for i, j in zip([0, *points], [*points, len(data)], strict=True)]


def expected(events) -> list[sse.Event]:
    return [
        sse.Event(name, "\n".join(data).encode(), None if i is None or "\x00" in i else i.encode())
        for name, data, i in events
    ]


@settings(max_examples=300, deadline=None)
@given(
    events=events_,
    framing=st.sampled_from(sorted(ENDS)),
    spaced=st.lists(st.booleans(), min_size=1, max_size=4),
    comments=st.booleans(),
    blanks=st.integers(min_value=0, max_value=2),
    at=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_every_framing_of_the_same_events_cut_anywhere_reads_as_the_same_events(
    events, framing, spaced, comments, blanks, at
):
    data = framed(events, ENDS[framing], spaced, comments, blanks)
    framer = sse.Framer()
    got = [sse.parse(e) for piece in cut(data, at) for e in framer.feed(piece)]
    # A last CR may be half of a CRLF: it is held until the next byte or the end.
    got += [sse.parse(e) for e in framer.close()]
    assert got == expected(events)
    assert not framer.pending


def test_an_event_cut_off_before_its_blank_line_is_no_event():
    framer = sse.Framer()
    assert framer.feed(b"data: 1\n\ndata: [DONE]\n") == [b"data: 1"]
    assert framer.pending


def test_what_the_writer_writes_the_framer_reads_back():
    written = sse.event(b"a\nb\r\nc", "x") + sse.comment(b"hi") + sse.json_event({"t": "\n"})
    events = [sse.parse(e) for e in sse.split(written)]
    assert events[1] == sse.Event("", None, None)  # a comment: relayed, but no event
    del events[1]
    assert events == [sse.Event("x", b"a\nb\nc", None), sse.Event("", b'{"t": "\\n"}', None)]


# -- readers: no content ends a stream -----------------------------------------------

MARKERS = [
    "data: [DONE]",
    "data:[DONE]",
    "event: message_stop",
    "event: response.completed",
    "event: response.incomplete",
    '"type":"message_stop"',
    '"usage":{"prompt_tokens":0,"completion_tokens":2}',
]
SEPARATORS = ["\n\n", "\r\n\r\n", "\r\r", "\n", ""]
hostile = st.lists(
    st.builds(lambda m, s: m + s, st.sampled_from(MARKERS), st.sampled_from(SEPARATORS)),
    min_size=1,
    max_size=4,
)
USAGE = {"prompt_tokens": 11, "completion_tokens": 7}


def chat_stream(pieces: list[str], end: bytes) -> bytes:
    chunks = [{"choices": [{"delta": {"content": p}}]} for p in pieces]
    chunks.append({"choices": [], "usage": USAGE})
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return (out + b"data: [DONE]\n\n").replace(b"\n", end)


def anthropic_stream(pieces: list[str], end: bytes) -> bytes:
    def ev(kind, **data):
        return sse.json_event({"type": kind, **data}, kind)

    out = ev("message_start", message={"usage": {"input_tokens": 11, "output_tokens": 1}})
    for p in pieces:
        out += ev("content_block_delta", index=0, delta={"type": "text_delta", "text": p})
    out += ev("message_delta", usage={"output_tokens": 7}) + ev("message_stop")
    return out.replace(b"\n", end)


def responses_stream(pieces: list[str], end: bytes) -> bytes:
    def ev(kind, **data):
        return sse.json_event({"type": kind, **data}, kind)

    out = ev("response.created", response={"usage": None})
    for p in pieces:
        out += ev("response.output_text.delta", delta=p)
    usage = {"input_tokens": 11, "output_tokens": 7}
    out += ev("response.completed", response={"usage": usage, "status": "completed"})
    return out.replace(b"\n", end)


def relay(reader, data: bytes, at: int) -> tuple[bytes, bool]:
    """The stream fed in two pieces cut at `at`: (what goes on, ended before the last
    piece was read)."""
    framer = sse.Framer()
    out, early = [], False
    for i, piece in enumerate((data[:at], data[at:])):
        out += reader.read(framer.feed(piece))
        early = early or (i == 0 and reader.meter.ended and at < len(data) - 2)
    out += reader.read(framer.close())
    return sse.join(out), early


def texts(relayed: bytes) -> str:
    out = []
    for e in sse.split(relayed):
        obj = sse.parse(e).json()
        if isinstance(obj, dict):
            if obj.get("choices"):
                out.append(obj["choices"][0]["delta"]["content"])
            elif "delta" in obj:
                d = obj["delta"]
                out.append(d["text"] if isinstance(d, dict) and "text" in d else d)
    return "".join(x for x in out if isinstance(x, str))


@settings(max_examples=60, deadline=None)
@given(pieces=hostile, framing=st.sampled_from(sorted(ENDS)))
def test_no_text_ends_a_stream_early_or_says_its_usage_cut_at_every_byte(pieces, framing):
    end = ENDS[framing]
    kinds = [
        (chat_stream, lambda m: OpenAIStream(m, client_usage=True)),
        (anthropic_stream, lambda m: NativeStream(m, anthropic.ENDS, anthropic.content)),
        (responses_stream, lambda m: NativeStream(m, responses.ENDS, responses.content)),
    ]
    for make, reader_for in kinds:
        data = make(pieces, end)
        for at in range(len(data) + 1):
            meter = Meter()
            out, early = relay(reader_for(meter), data, at)
            assert not early, (make.__name__, at)
            assert meter.ended, (make.__name__, at)
            assert (meter.prompt_tokens, meter.completion_tokens) == (11, 7)
            assert meter.events == len(pieces)
            assert texts(out) == "".join(pieces)


def test_a_stream_cut_short_bills_its_content_events_and_what_it_said_so_far():
    meter = Meter()
    reader = NativeStream(meter, anthropic.ENDS, anthropic.content)
    data = anthropic_stream(["a", "b", "c"], b"\n")
    reader.read(sse.split(data[: data.index(b"event: message_delta")]))
    assert not meter.ended
    assert (meter.prompt_tokens, meter.completion) == (11, 3)  # not message_start's 1


def test_events_after_the_end_are_not_relayed_or_counted():
    meter = Meter()
    reader = OpenAIStream(meter, client_usage=True)
    data = chat_stream(["a"], b"\n") + b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    out = reader.read(sse.split(data))
    assert out[-1] == b"data: [DONE]" and meter.events == 1
    assert reader.read(sse.split(b'data: {"choices":[]}\n\n')) == []
