"""Bad input gets a clear OpenAI-shaped answer, and the router stays up through all of it."""

import json

import pytest

from tests.helpers import eventually, llmgw

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def assert_error(resp, status, code, param=None, retry=False):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["message"]
    assert err["param"] == param
    assert resp.headers["x-request-id"]
    if not retry:
        assert resp.headers["x-should-retry"] == "false"
    return err


@pytest.mark.parametrize(
    "raw,code,param",
    [
        ("{not json", "invalid_json", None),
        ("[1, 2]", "invalid_json", None),
        (json.dumps({"messages": []}), "invalid_value", "model"),
        (json.dumps({"model": 7, "messages": []}), "invalid_value", "model"),
        (json.dumps({"model": "m"}), "missing_required_parameter", "messages"),
        (json.dumps({"model": "m", "messages": "hi"}), "invalid_type", "messages"),
        (json.dumps({"model": "m", "messages": []}), "invalid_type", "messages"),
        (json.dumps({**CHAT, "stream": "yes"}), "invalid_type", "stream"),
        (json.dumps({**CHAT, "stream_options": 3}), "invalid_type", "stream_options"),
    ],
)
def test_a_malformed_request_is_answered_400_naming_the_field(router, raw, code, param):
    assert_error(router.post("/v1/chat/completions", raw=raw), 400, code, param)


def test_every_kind_of_bad_request_leaves_the_router_serving(router, engine):
    router.post("/v1/chat/completions", raw=b"\xff\xfe")
    router.post("/v1/completions", raw="{}")
    router.post("/v1/embeddings", {"model": "m", "input": 5})
    assert router.post("/v1/chat/completions", CHAT).status_code == 200


def test_a_request_without_a_key_is_401(router):
    assert_error(router.post("/v1/chat/completions", CHAT, key=None), 401, "invalid_api_key")


def test_an_unknown_key_is_401(router):
    err = assert_error(
        router.post("/v1/chat/completions", CHAT, key="sk-llmgw-nope"), 401, "invalid_api_key"
    )
    assert "sk-llmgw-nope" not in err["message"]


def test_a_model_the_key_may_not_use_is_403(make_router, engine):
    router = make_router([engine.url])
    limited = json.loads(
        llmgw("keys", "create", "--store", "--name", "l", "--models", "other", "--json").stdout
    )["secret"]

    def answered():
        resp = router.post("/v1/chat/completions", CHAT, key=limited)
        return [resp] if resp.status_code != 401 else None

    (resp,) = eventually(answered, timeout=20, what="the router to know the new key")
    assert_error(resp, 403, "model_not_allowed", "model")


def test_an_unknown_model_is_404_model_not_found(router):
    assert_error(
        router.post("/v1/chat/completions", {**CHAT, "model": "nope"}),
        404,
        "model_not_found",
        "model",
    )


def test_a_body_over_the_limit_is_413(make_router, engine):
    router = make_router([engine.url], max_body_bytes=1000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_error(router.post("/v1/chat/completions", big), 413, "request_too_large")
    # A chunked body (no Content-Length) is held to the same limit.
    chunks = iter([json.dumps(big).encode()])
    assert_error(router.post("/v1/chat/completions", raw=chunks), 413, "request_too_large")


def test_an_unknown_path_is_an_openai_shaped_404(router):
    assert_error(router.get("/v1/nothing"), 404, "unknown_url")


def test_streaming_embeddings_is_refused(router):
    resp = router.post("/v1/embeddings", {"model": "m", "input": "a", "stream": True})
    assert_error(resp, 400, "invalid_value", "stream")


def test_no_stack_trace_ever_reaches_the_client(router):
    resp = router.post("/v1/chat/completions", raw='{"model": "m", "messages": [1], "n": {}}')
    assert "Traceback" not in resp.text
