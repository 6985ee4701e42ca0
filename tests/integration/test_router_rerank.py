"""Reranking, passed through by model under both of its names."""

import pytest

from tests.helpers import eventually
from tests.integration.conftest import ctl

BODY = {"model": "m", "query": "fox", "documents": ["a", "a quick fox", "the fox"], "top_n": 2}


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/reranking"])
def test_a_rerank_is_passed_through_by_model_and_named_as_served(router, engine, path):
    resp = router.post(path, BODY)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [r["index"] for r in body["results"]] == [1, 2]
    assert body["model"] == "m"  # not the engine's weights path
    assert resp.headers["x-llmgw-served-model"] == "m"
    assert engine.stats()["last_body"]["query"] == "fox"


def test_a_rerank_for_an_unknown_model_or_without_documents_is_refused(router):
    assert router.post("/v1/rerank", {**BODY, "model": "nope"}).status_code == 404
    missing = router.post("/v1/rerank", {"model": "m", "query": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "documents"


def test_a_rerank_is_refused_to_a_key_that_may_not_use_the_model(router):
    narrow = ctl("keys", "create", "--name", "narrow", "--models", "other")["secret"]
    eventually(lambda: router.get("/v1/models", key=narrow).status_code == 200, what="key")
    assert router.post("/v1/rerank", BODY, key=narrow).status_code == 403
