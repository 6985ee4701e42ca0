"""The router's OpenAI API, through the real openai client and raw HTTP, on a fake engine."""

import json

import openai
import pytest

from tests.helpers import llmgw

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key=router.secret, max_retries=0)


def test_a_chat_completion_comes_back_with_the_served_model_and_a_request_id(client, engine):
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    completion = raw.parse()
    assert completion.choices[0].message.content == "The quick brown fox jumps"
    assert completion.usage.completion_tokens == 5
    assert raw.headers["x-llmgw-served-model"] == "m"
    assert raw.headers["x-request-id"]
    # Only the router can use the engine: it sent the engine key, not the client's.
    assert engine.stats()["last_headers"]["Authorization"] == "Bearer engine-key-for-tests"


def test_a_completion_and_an_embedding_pass_through(client):
    assert client.completions.create(model="m", prompt="x").choices[0].text.startswith("The")
    emb = client.embeddings.create(model="m", input=["a", "b"])
    assert len(emb.data) == 2 and emb.usage.prompt_tokens == 6


def test_a_stream_arrives_chunk_by_chunk_and_hides_usage_the_client_did_not_ask_for(client, engine):
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The quick brown fox jumps"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks), "the usage-only chunk must be stripped"
    # ... but the engine was asked for usage all the same, for the usage row.
    assert engine.stats()["last_body"]["stream_options"] == {"include_usage": True}


def test_a_stream_ends_with_usage_when_the_client_asked_for_it(client):
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 7


def test_a_stream_is_forwarded_before_the_engine_has_finished(router, engine):
    engine.control(mode="hold", drop_after=1, chunks=3)
    with router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        # The engine is still holding the rest: the first chunk was not buffered.
        assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "The"
        assert engine.stats()["active"] == 1
        engine.control(release=True)
        rest = [line for line in lines if line]
    assert rest[-1] == b"data: [DONE]"


def test_a_slow_first_token_is_kept_alive_with_sse_comments(make_router, engine):
    router = make_router([engine.url], keepalive_interval_s=0.1)
    engine.control(mode="hold", drop_after=0, chunks=2)
    with router.post("/v1/chat/completions", {**CHAT, "stream": True}, stream=True) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line) == b": keepalive"
        engine.control(release=True)
        rest = [line for line in lines if line and not line.startswith(b":")]
    assert rest[-1] == b"data: [DONE]" and len(rest) == 3


def test_the_model_list_shows_what_the_key_may_use(router):
    body = router.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["m"]


def test_every_answer_names_the_served_model_not_the_engines_weights_path(router, engine):
    """The fake engine, like llama-server without --alias, says its weights' path."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert router.post("/v1/chat/completions", chat).json()["model"] == "m"
    embedded = router.post("/v1/embeddings", {"model": "m", "input": "hi"}).json()
    assert embedded["model"] == "m"
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": "m", "prompt": "hi"})):  # fmt: skip
        for usage in (True, False):
            streamed = {**body, "stream": True, "stream_options": {"include_usage": usage}}
            with router.post(path, streamed, stream=True) as resp:
                chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith(b"data: {")]  # fmt: skip
            assert len(chunks) == 5 + usage
            assert {c["model"] for c in chunks} == {"m"}


def test_an_alias_is_asked_of_the_engine_and_answered_as_its_model(limited_router, engine):
    secret = json.loads(llmgw("keys", "create", "--store", "--name", "a", "--json").stdout)
    client = limited_router(
        secret["secret"],
        extra='[[models]]\nname = "m"\naliases = ["mm"]\nsource = "/models/m.gguf"\n',
        models=("m", "mm"),
    )
    resp = client.chat({**CHAT, "model": "mm"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "m"
    assert engine.stats()["last_body"]["model"] == "m"
