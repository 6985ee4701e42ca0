"""Byte splices on the request path: answers carry the served model's name (`"model"`),
a client that asked no usage gets none (the `usage` member cut out), and the engine is
asked for usage (`stream_options` spliced into the request)."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_router import sse
from llmgw_router.meter import Meter, OpenAIStream
from llmgw_router.splice import ask_usage, model_field, set_model, without_usage

FIELD = model_field("gemma3-270m")
PATH = '/var/lib/llmgw/weights/gemma-"q4"/m.gguf\\'


def events(*objs, sep=(",", ":")) -> bytes:
    return b"".join(b"data: " + json.dumps(o, separators=sep).encode() + b"\n\n" for o in objs)


def models_in(block: bytes) -> list:
    return [json.loads(e[6:])["model"] for e in block.split(b"\n\n") if e.startswith(b"data: {")]


@pytest.mark.parametrize("sep", [(",", ":"), (", ", ": "), (",", " : ")])
def test_every_streamed_chunk_says_the_served_name_however_the_engine_spaced_it(sep):
    chunk = {"choices": [{"delta": {"content": "hi"}}], "model": PATH, "object": "x"}
    block = events(chunk, chunk, {"model": PATH, "choices": [], "usage": {"prompt_tokens": 1}},
                   sep=sep) + b"data: [DONE]\n\n"  # fmt: skip
    out = set_model(block, FIELD)
    assert models_in(out) == ["gemma3-270m"] * 3
    assert out.endswith(b"data: [DONE]\n\n")
    for before, after in zip(block.split(b"\n\n"), out.split(b"\n\n"), strict=True):
        if before.startswith(b"data: {"):  # nothing else in the chunk changed
            a, b = json.loads(before[6:]), json.loads(after[6:])
            assert {**a, "model": "gemma3-270m"} == b


def test_text_that_mentions_a_model_field_is_left_as_it_is():
    text = 'say {"model": "x"} and \\"model\\": \\\\"y\\\\" and "model"'
    chunk = {"choices": [{"delta": {"content": text}}], "model": PATH}
    out = set_model(events(chunk), FIELD)
    (obj,) = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert obj["choices"][0]["delta"]["content"] == text
    assert obj["model"] == "gemma3-270m"


def test_a_string_value_model_and_a_non_string_model_are_not_touched():
    data = json.dumps({"object": "model", "tags": ["model"], "model": None}).encode()
    assert set_model(data, FIELD) == data


def test_an_answer_that_already_says_the_name_is_returned_as_the_same_bytes():
    data = events({"model": "gemma3-270m", "choices": []})
    assert set_model(data, FIELD) is data


def test_a_whole_answer_gets_the_name_and_names_are_json_escaped():
    data = json.dumps({"id": "1", "model": PATH, "choices": [], "usage": {}}).encode()
    field = model_field('we"ird\\name')
    assert json.loads(set_model(data, field))["model"] == 'we"ird\\name'


def test_bytes_that_are_not_json_come_back_unchanged():
    for data in (b'"model": "unterminated \\"', b"", b'"model"', b'x"model":'):
        assert set_model(data, FIELD) == data


# -- a stream the client asked no usage of: the usage member cut out of the bytes -------

STREAMS = sorted((Path(__file__).parent.parent / "fixtures" / "chat_streams").glob("*.sse"))


def parse_and_dump(block: bytes) -> bytes:
    """What the router did before the splice: every usage event parsed, the usage-only
    one dropped, the usage member of one with choices deleted and the rest re-serialised."""
    kept = []
    for event in block.split(b"\n\n"):
        if not event:
            continue
        if event.startswith(b"data: {") and b'"usage"' in event:
            obj = json.loads(event[6:])
            if isinstance(obj.get("usage"), dict):
                if not obj.get("choices"):
                    continue
                del obj["usage"]
                event = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        kept.append(event)
    return b"".join(e + b"\n\n" for e in kept)


def with_usage_on_chunks(block: bytes) -> list[bytes]:
    """The stream as it came, and as engines that put usage on a chunk with choices send
    it: usage first, in the middle and last among the members of each content chunk."""
    events = [e for e in block.split(b"\n\n") if e]
    usage = next(json.loads(e[6:])["usage"] for e in events if b'"usage"' in e)
    variants = [block]
    for where in ("first", "middle", "last"):
        out = []
        for e in events:
            if not e.startswith(b"data: {") or b'"usage"' in e:
                out.append(e)
                continue
            items = list(json.loads(e[6:]).items())
            at = {"first": 0, "middle": len(items) // 2, "last": len(items)}[where]
            items.insert(at, ("usage", usage))
            out.append(b"data: " + json.dumps(dict(items), separators=(",", ":")).encode())
        variants.append(b"".join(e + b"\n\n" for e in out))
    return variants


def relayed(block: bytes, client_usage: bool) -> tuple[bytes, Meter]:
    """The stream as the router relays it to the client, and what it metered."""
    meter = Meter()
    return sse.join(OpenAIStream(meter, client_usage).read(sse.split(block))), meter


@pytest.mark.parametrize("path", STREAMS, ids=lambda p: p.name)
def test_the_usage_splice_equals_parsing_and_dumping_over_the_captured_streams(path):
    for block in with_usage_on_chunks(path.read_bytes()):
        out, meter = relayed(block, client_usage=False)
        assert out == parse_and_dump(block)
        assert meter.prompt_tokens > 0 and meter.completion_tokens > 0
        assert meter.events == content_events(block)
        assert meter.ended


def content_events(block: bytes) -> int:
    """Chunks that carry a generated token: content, a tool call's piece (not the role
    chunk, the finish chunk or the usage-only one)."""
    n = 0
    for event in block.split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices") or []:
                delta = choice.get("delta") or {}
                n += bool(delta.get("content") or delta.get("tool_calls"))
    return n


@pytest.mark.parametrize("path", STREAMS, ids=lambda p: p.name)
def test_a_client_that_asked_for_usage_gets_the_stream_byte_for_byte(path):
    for block in with_usage_on_chunks(path.read_bytes()):
        assert relayed(block, client_usage=True)[0] == block


json_text = st.text(alphabet=st.sampled_from('ab "\\:{}[],usage\n'), max_size=12)
json_values = st.recursive(
    st.none() | st.integers() | json_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(json_text, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    members=st.dictionaries(json_text.filter(lambda k: k != "usage"), json_values, max_size=4),
    usage=st.dictionaries(json_text, json_values, max_size=3),
    at=st.integers(min_value=0, max_value=4),
    spaced=st.booleans(),
)
def test_cutting_usage_out_of_the_bytes_leaves_the_same_object_or_declines(
    members, usage, at, spaced
):
    items = list(members.items())
    items.insert(min(at, len(items)), ("usage", usage))
    sep = (", ", ": ") if spaced else (",", ":")
    event = b"data: " + json.dumps(dict(items), separators=sep).encode()
    cut = without_usage(event)
    if cut is None:  # allowed only where the bytes cannot tell which member it is
        assert not members or event.count(b'"usage"') > 1
        return
    assert json.loads(cut[6:]) == members
    if not spaced:
        assert cut == b"data: " + json.dumps(members, separators=sep).encode()


def test_a_streamed_request_without_stream_options_gets_include_usage_spliced_in():
    body = b'  {"model":"m","stream":true,"messages":[{"role":"user","content":"{\\"x"}]}'
    spliced = ask_usage(body)
    assert json.loads(spliced) == {**json.loads(body), "stream_options": {"include_usage": True}}
    assert ask_usage(b"\xef\xbb\xbf" + body.strip()) is None  # a BOM: serialise instead


model_text = st.text(alphabet=st.sampled_from('mo"del\\: {}x'), max_size=10)
with_models = st.recursive(
    st.none() | st.integers() | model_text | st.sampled_from([PATH, "gemma3-270m", "model"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["model", "x", 'a"model', "model\\"]) | model_text, inner, max_size=3
        )
    ),  # fmt: skip
    max_leaves=10,
)


@settings(max_examples=400, deadline=None)
@given(docs=st.lists(with_models, min_size=1, max_size=4), spaced=st.booleans())
def test_the_quick_ways_of_naming_the_model_agree_with_the_careful_one(docs, spaced):
    from llmgw_router.splice import _set_model_each

    sep = (", ", ": ") if spaced else (",", ":")
    block = b"".join(b"data: " + json.dumps(d, separators=sep).encode() + b"\n\n" for d in docs)
    for field in (FIELD, model_field(PATH), model_field("model")):
        assert set_model(block, field) == _set_model_each(block, field)


def test_a_name_that_only_ends_in_model_keeps_its_value():
    # The key a"model is written a\"model: its last quote and `model` look like a member
    # named model; only the real member's value becomes the served name.
    data = events({"model": PATH, 'a"model': PATH})
    out = json.loads(set_model(data, FIELD)[6:])
    assert out == {"model": "gemma3-270m", 'a"model': PATH}
