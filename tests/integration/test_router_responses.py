"""OpenAI's Responses API through the real openai client, on the fake engine, which
serves only chat completions unless told to serve /v1/responses as llama-server does:
the router translates (or passes through), keeps the state as a chain of responses, and
makes every answer the response object the OpenResponses specification requires."""

import json

import openai
import pytest

from llmgw.store import StoredResponse, open_store
from tests.helpers import eventually, start_router
from tests.integration.conftest import ENGINE_KEY, ctl
from tests.integration.test_router_admission import CATALOG
from tests.unit.test_responses_spec import problems


def client_for(url, secret):
    return openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0)


@pytest.fixture
def client(router):
    with client_for(router.url, router.secret) as c:
        yield c


def test_a_response_is_answered_through_chat_with_usage(client, engine):
    raw = client.responses.with_raw_response.create(
        model="m", input="hi", instructions="Be brief.", max_output_tokens=20
    )
    resp = raw.parse()
    assert resp.output_text == "The quick brown fox jumps"
    assert (resp.model, resp.status, resp.object) == ("m", "completed", "response")
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (7, 5)
    assert raw.headers["x-llmgw-served-model"] == "m"
    sent = engine.stats()["last_body"]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert sent["max_tokens"] == 20


def test_a_response_streams_its_events_in_order(client):
    events = list(client.responses.create(model="m", input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.output_item.done"):  # fmt: skip
        assert kind in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "The quick brown fox jumps"
    assert events[-1].response.usage.output_tokens == 5


def test_a_continuation_carries_the_whole_conversation_to_the_engine(client, engine):
    first = client.responses.create(model="m", input="hi")
    second = client.responses.create(model="m", input="and then?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert engine.stats()["last_body"]["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "The quick brown fox jumps"},
        {"role": "user", "content": "and then?"},
    ]
    third = client.responses.create(model="m", input="more", previous_response_id=second.id)
    assert len(engine.stats()["last_body"]["messages"]) == 5
    items = client.responses.input_items.list(third.id, order="asc")
    assert [i.content[0].text for i in items.data] == [
        "hi", "The quick brown fox jumps", "and then?", "The quick brown fox jumps", "more",
    ]  # fmt: skip


def test_a_stored_response_is_retrieved_and_deleted(client):
    made = client.responses.create(model="m", input="hi")
    assert client.responses.retrieve(made.id).output_text == made.output_text
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="again", previous_response_id=made.id)


def test_a_response_not_stored_cannot_be_continued(client):
    made = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_another_key_gets_404_never_the_content(router, client):
    made = client.responses.create(model="m", input="a secret")
    other = ctl("keys", "create", "--name", "other")["secret"]
    with client_for(router.url, other) as c:
        eventually(lambda: c.models.list(), what="the router to know the new key")
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.retrieve(made.id)
        assert "a secret" not in err.value.response.text
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="m", input="x", previous_response_id=made.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.delete(made.id)
    assert client.responses.retrieve(made.id).id == made.id


def test_input_tokens_counts_the_whole_conversation_and_keeps_nothing(router, client, engine):
    first = client.responses.create(model="m", input="hi")
    counted = client.responses.input_tokens.count(
        model="m", input="and then?", previous_response_id=first.id
    )
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", 7)
    sent = engine.stats()["last_body"]
    assert sent["max_tokens"] == 1 and "stream" not in sent
    assert [m["content"] for m in sent["messages"]] == [
        "hi",
        "The quick brown fox jumps",
        "and then?",
    ]
    other = ctl("keys", "create", "--name", "counter")["secret"]
    with client_for(router.url, other) as c:
        eventually(lambda: c.models.list(), what="the router to know the new key")
        with pytest.raises(openai.NotFoundError):
            c.responses.input_tokens.count(model="m", input="x", previous_response_id=first.id)


def test_a_field_chat_cannot_carry_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="hi", reasoning={"effort": "high"})
    assert err.value.body["param"] == "reasoning"


def test_a_response_made_through_one_router_continues_through_another(pg_store, tmp_path, engine):
    (tmp_path / "engine.key").write_text(ENGINE_KEY + "\n")
    secret = ctl("keys", "create", "--name", "fleet")["secret"]
    procs = []
    try:
        urls = []
        for _ in range(2):
            proc, url = start_router(
                tmp_path,
                '[router]\nlisten = "127.0.0.1:{port}"\n'
                f'[[router.endpoints]]\nid = "e0"\nurl = "{engine.url}"\nmodels = ["m"]\n'
                f'key = "@{tmp_path / "engine.key"}"\n',
            )
            procs.append(proc)
            urls.append(url)
        with client_for(urls[0], secret) as a, client_for(urls[1], secret) as b:
            made = a.responses.create(model="m", input="hi")

            def continued():
                try:
                    return b.responses.create(model="m", input="on", previous_response_id=made.id)
                except openai.NotFoundError:
                    return None  # not in the store yet

            assert eventually(continued, what="the other router to continue it").id
            assert len(engine.stats()["last_body"]["messages"]) == 3
    finally:
        for proc in procs:
            proc.stop()


def test_a_response_falls_back_and_its_continuation_names_the_model_that_answered(
    limited_router, engine
):
    secret = ctl("keys", "create", "--name", "fb")["secret"]
    router = limited_router(secret, extra=CATALOG, models=("small",))
    with client_for(router.url, secret) as c:
        raw = c.responses.with_raw_response.create(model="big", input="hi")
        made = raw.parse()
        assert raw.headers["x-llmgw-served-model"] == "small"
        assert made.model == "small" and engine.stats()["last_body"]["model"] == "small"
        assert c.responses.retrieve(made.id).model == "small"


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("native", [True, False], ids=["native", "translated"])
def test_every_answer_whole_or_streamed_is_the_specs_response_object(router, engine, native):
    engine.control(responses=native)
    asked = {"model": "m", "input": "hi", "instructions": "Be brief.", "temperature": 0.2,
             "metadata": {"ticket": "42"}, "max_output_tokens": 30}  # fmt: skip
    whole = router.post("/v1/responses", asked)
    assert whole.status_code == 200, whole.text
    first = whole.json()
    assert problems(first) == []
    assert (first["instructions"], first["temperature"], first["metadata"]) == (
        "Be brief.", 0.2, {"ticket": "42"})  # fmt: skip
    assert (first["store"], first["previous_response_id"], first["top_p"]) == (True, None, 1.0)
    streamed = router.post(
        "/v1/responses",
        {"model": "m", "input": "more", "previous_response_id": first["id"], "stream": True},
    )
    assert streamed.status_code == 200, streamed.text
    completed = [e for e in sse_events(streamed.text) if e["type"] == "response.completed"]
    (done,) = completed
    assert problems(done["response"]) == []
    assert done["response"]["previous_response_id"] == first["id"]
    assert done["response"]["output"][0]["content"][0]["text"] == "The quick brown fox jumps"
    assert (engine.stats()["unknown_paths"] == []) is native
    sent = engine.stats()["last_body"]
    assert "previous_response_id" not in sent and "store" not in sent
    if native:  # the engine had the conversation, as it has no state
        assert [i["content"] for i in sent["input"]] == ["hi", "The quick brown fox jumps", "more"]
    assert router.get(f"/v1/responses/{done['response']['id']}").json() == done["response"]


def _stored(router) -> dict:
    db = open_store(router.store_url)
    try:
        return {r.id: r for r in StoredResponse.select()}
    finally:
        db.close()


def test_a_long_conversation_is_stored_one_turn_a_response(router, client, engine):
    made = []
    for turn in range(6):
        prev = made[-1].id if made else None
        made.append(client.responses.create(model="m", input=f"turn {turn}",
                                            previous_response_id=prev))  # fmt: skip
    assert len(engine.stats()["last_body"]["messages"]) == 11  # five turns and this one
    rows = eventually(lambda: (r := _stored(router)) and len(r) == 6 and r, what="the writes")
    for turn, resp in enumerate(made):
        row = rows[resp.id]
        assert json.loads(row.input) == [{"type": "message", "role": "user",
                                          "content": f"turn {turn}"}]  # fmt: skip
        assert json.loads(row.context) == []
        assert row.previous_id == (made[turn - 1].id if turn else None)
    items = client.responses.input_items.list(made[-1].id, order="asc", limit=100)
    assert [i.content[0].text for i in items.data] == [
        text for turn in range(6) for text in (f"turn {turn}", "The quick brown fox jumps")
    ][:-1]


def test_a_conversation_longer_than_the_bound_is_refused_with_a_clear_400(make_router, engine):
    router = make_router([engine.url], responses_chain_max=2)
    with client_for(router.url, router.secret) as c:
        r1 = c.responses.create(model="m", input="one")
        r2 = c.responses.create(model="m", input="two", previous_response_id=r1.id)
        r3 = c.responses.create(model="m", input="three", previous_response_id=r2.id)
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="m", input="four", previous_response_id=r3.id)
    error = err.value.body
    assert (error["code"], error["param"]) == ("conversation_too_long", "previous_response_id")
    assert "more than 2 stored responses" in error["message"]


def test_continuing_past_a_deleted_response_is_404_naming_it(client):
    r1 = client.responses.create(model="m", input="one")
    r2 = client.responses.create(model="m", input="two", previous_response_id=r1.id)
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="three", previous_response_id=r2.id)
    assert err.value.body["code"] == "response_not_found"
    assert r1.id in err.value.body["message"] and r2.id in err.value.body["message"]
    assert client.responses.retrieve(r2.id).id == r2.id  # it is there, and says what it was
