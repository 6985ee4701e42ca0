"""GET /v1/models/{id} through the real openai client."""

import json

import openai
import pytest

from tests.helpers import llmgw

CATALOG = '[[models]]\nname = "m"\naliases = ["mm"]\nsource = "/models/m.gguf"\n'


def client_for(url, secret):
    return openai.OpenAI(base_url=url + "/v1", api_key=secret, max_retries=0)


def make_key(*args):
    return json.loads(llmgw("keys", "create", "--store", "--json", *args).stdout)["secret"]


def test_a_served_model_is_retrieved_as_openai_describes_a_model(router):
    model = client_for(router.url, router.secret).models.retrieve("m")
    assert (model.id, model.object, model.owned_by) == ("m", "model", "llmgw")


def test_an_alias_is_retrieved_as_the_model_it_names(limited_router):
    secret = make_key("--name", "a")
    client = limited_router(secret, extra=CATALOG, models=("m", "mm"))
    assert client_for(client.url, secret).models.retrieve("mm").id == "m"


def test_an_unknown_model_is_not_found_in_openais_shape(router):
    with pytest.raises(openai.NotFoundError) as err:
        client_for(router.url, router.secret).models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found"
    assert err.value.response.headers["x-request-id"]


def test_a_model_the_key_may_not_use_is_not_found_for_that_key(limited_router):
    secret = make_key("--name", "narrow", "--models", "other")
    client = limited_router(secret, models=("m", "other"))
    with pytest.raises(openai.NotFoundError):
        client_for(client.url, secret).models.retrieve("m")
    assert client_for(client.url, secret).models.retrieve("other").id == "other"


def test_a_model_is_not_retrieved_without_a_valid_key(router):
    with pytest.raises(openai.AuthenticationError):
        client_for(router.url, "wrong").models.retrieve("m")
