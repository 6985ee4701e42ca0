"""Answers carry the served model's name: the byte splice of `"model"` in call.py."""

import json

import pytest

from llmgw_router.call import model_field, set_model

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
