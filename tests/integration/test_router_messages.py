"""Anthropic's Messages API through the real anthropic SDK, on the fake engine, which
serves only chat completions: the router learns that and translates."""

import os

import anthropic
import pytest
import requests

from llmgw.store import Usage, open_store
from tests.helpers import eventually, llmgw
from tests.integration.conftest import ctl

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client_for():
    """Anthropic clients, closed after the test (an open one's socket would warn)."""
    made = []

    def make(url, secret, **kw):
        made.append(anthropic.Anthropic(base_url=url, max_retries=0, **{"api_key": secret, **kw}))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def client(router, client_for):
    return client_for(router.url, router.secret)


def test_a_message_is_answered_through_chat_with_usage_and_the_served_model(client, engine):
    raw = client.messages.with_raw_response.create(
        model="m", max_tokens=20, system="Be brief.", messages=HI
    )
    msg = raw.parse()
    assert msg.content[0].text == "The quick brown fox jumps"
    assert (msg.model, msg.stop_reason, msg.role) == ("m", "end_turn", "assistant")
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (7, 5)
    assert raw.headers["x-llmgw-served-model"] == "m"
    assert raw.headers["x-request-id"]
    sent = engine.stats()["last_body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, *HI]
    assert sent["max_tokens"] == 20


def test_a_message_streams_the_whole_event_sequence(client):
    with client.messages.stream(model="m", max_tokens=20, messages=HI) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "The quick brown fox jumps"
    assert final.usage.output_tokens == 5 and final.stop_reason == "end_turn"


def test_the_tokens_of_a_message_are_counted_by_the_engine(client, engine):
    counted = client.messages.count_tokens(model="m", messages=HI)
    assert counted.input_tokens == 7
    assert engine.stats()["last_body"]["max_tokens"] == 1


def test_the_key_may_come_as_a_bearer_token_too(router, client_for):
    bearer = client_for(router.url, None, auth_token=router.secret)
    assert bearer.messages.create(model="m", max_tokens=5, messages=HI).content


def test_a_bad_key_is_an_authentication_error(router, client_for):
    with pytest.raises(anthropic.AuthenticationError) as err:
        client_for(router.url, "wrong").messages.create(model="m", max_tokens=5, messages=HI)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_requests_are_counted_by_the_api_they_came_by(router, client, client_for):
    client.messages.create(model="m", max_tokens=5, messages=HI)
    with pytest.raises(anthropic.AuthenticationError):
        client_for(router.url, "wrong").messages.create(model="m", max_tokens=5, messages=HI)
    text = requests.get(router.url + "/metrics", timeout=5).text
    assert 'llmgw_router_api_requests_total{api="/v1/messages",status="200"} 1.0' in text
    assert 'llmgw_router_api_requests_total{api="/v1/messages",status="401"} 1.0' in text
    assert 'api="/v1/chat/completions"' not in text


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=5, messages=HI)
    assert err.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "The model 'nope' does not exist."},
    }


def test_a_malformed_body_is_a_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=5, messages=[])
    assert err.value.body["error"]["type"] == "invalid_request_error"


def test_a_field_chat_cannot_carry_is_refused_by_name(client, engine):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="m",
            max_tokens=50,
            messages=HI,
            thinking={"type": "enabled", "budget_tokens": 20},
        )
    assert "'thinking'" in err.value.body["error"]["message"]


def test_a_limited_key_is_rate_limited_with_retry_after(limited_router, client_for):
    key = ctl("keys", "create", "--name", "one-a-minute")
    llmgw("limits", "set", "--key", key["id"], "--rpm", "1", "--store")
    client = limited_router(key["secret"])
    c = client_for(client.url, key["secret"])
    c.messages.create(model="m", max_tokens=5, messages=HI)
    with pytest.raises(anthropic.RateLimitError) as err:
        c.messages.create(model="m", max_tokens=5, messages=HI)
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_a_message_is_accounted_in_tokens_with_its_api_named(client):
    raw = client.messages.with_raw_response.create(model="m", max_tokens=5, messages=HI)
    rid = raw.headers["x-request-id"]
    db = open_store(os.environ["LLMGW_STORE"])
    try:
        row = eventually(lambda: Usage.get_or_none(Usage.request_id == rid), what="the row")
    finally:
        db.close()
    assert (row.api, row.prompt_tokens, row.completion_tokens) == ("/v1/messages", 7, 5)


def test_counting_tokens_is_recorded_without_tokens(client):
    raw = client.messages.with_raw_response.count_tokens(model="m", messages=HI)
    rid = raw.headers["x-request-id"]
    db = open_store(os.environ["LLMGW_STORE"])
    try:
        row = eventually(lambda: Usage.get_or_none(Usage.request_id == rid), what="the row")
    finally:
        db.close()
    assert (row.api, row.prompt_tokens, row.completion_tokens) == (
        "/v1/messages/count_tokens", 0, 0,
    )  # fmt: skip


def test_a_model_whose_catalog_engine_lacks_the_api_is_translated_from_the_first_request(
    limited_router, engine, client_for
):
    secret = ctl("keys", "create", "--name", "v")["secret"]
    catalog = ('[[models]]\nname = "m"\nsource = "/models/m"\nengine = "vllm"\n'
               "[models.profile]\ngpus = 1\n")  # fmt: skip
    router = limited_router(secret, extra=catalog)
    msg = client_for(router.url, secret).messages.create(model="m", max_tokens=5, messages=HI)
    assert msg.content[0].text == "The quick brown fox jumps"
    assert engine.stats()["unknown_paths"] == []  # straight to chat: no refused request first


def test_an_engine_that_lacks_the_api_is_asked_natively_only_once(client, engine):
    for _ in range(3):
        client.messages.create(model="m", max_tokens=5, messages=HI)
    assert engine.stats()["unknown_paths"] == ["/v1/messages"]
    assert engine.stats()["requests"] == 3


def test_a_saturated_model_is_overloaded_error_529(limited_router, engine, client_for):
    # The engine's own /slots says its one slot is busy (another router's request).
    engine.control(n_slots=1, extra_busy=1)
    secret = ctl("keys", "create", "--name", "busy")["secret"]
    router = limited_router(secret, extra="queue_deadline_s = 0.3\nengine_probe_s = 0.1\n")
    c = client_for(router.url, secret)

    def overloaded():
        try:
            c.messages.create(model="m", max_tokens=5, messages=HI)
        except anthropic.APIStatusError as e:
            return e if e.status_code == 529 else None
        return None

    err = eventually(overloaded, what="the probe to see /slots busy")
    assert err.body["error"]["type"] == "overloaded_error"
    assert int(err.response.headers["retry-after"]) >= 1
