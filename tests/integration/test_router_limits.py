"""Limits and budgets at every level, through a real router on a fake engine, with
tenancy made by the real CLI."""

import json
import threading
import time

import pytest

from tests.helpers import eventually, llmgw
from tests.integration.conftest import CHAT, ctl

# The fake engine's answer: 7 prompt tokens, 5 completion tokens.
USED = 12


def reservation(body: dict) -> int:
    """What the router reserves from a tpm limit: a quarter of the body's bytes, plus
    one (the prompt's estimate), plus max_tokens."""
    return len(json.dumps(body)) // 4 + 1 + body["max_tokens"]


def budget_reservation(body: dict) -> int:
    """... and from a token budget, which must not be overspent: the body's bytes (no
    prompt has more tokens than that), plus max_tokens."""
    return len(json.dumps(body)) + body["max_tokens"]


@pytest.fixture
def acme():
    """Org acme with team research; user ada in it, project bot; ada's key for bot."""
    llmgw("orgs", "create", "acme", "--store")
    llmgw("teams", "create", "research", "--org", "acme", "--store")
    llmgw("users", "create", "ada", "--team", "research", "--store")
    llmgw("projects", "create", "bot", "--org", "acme", "--team", "research", "--store")
    key = ctl("keys", "create", "--name", "ada-bot", "--user", "ada", "--project", "bot")
    return key


def away_from_a_minute_boundary(seconds: float = 8.0) -> None:
    """Wait, if need be, so the next `seconds` fall inside one clock minute (rate
    limits count in fixed minutes)."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)


LEVELS = ["key", "user", "project", "team", "org"]


def subject_of(acme: dict, scope: str) -> str:
    return {"key": acme["id"], "user": "ada", "project": "bot", "team": "research",
            "org": "acme"}[scope]  # fmt: skip


@pytest.mark.parametrize("scope", LEVELS)
def test_an_rpm_limit_at_each_level_refuses_the_request_past_it(acme, limited_router, scope):
    subject = subject_of(acme, scope)
    away_from_a_minute_boundary()
    llmgw("limits", "set", f"--{scope}", subject, "--rpm", "3", "--store")
    client = limited_router(acme["secret"])
    answers = [client.chat() for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert f"{scope} '{subject}'" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.headers["x-ratelimit-limit-requests"] == "3"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "2"
    assert answers[0].headers["x-ratelimit-reset-requests"].endswith("s")
    assert 'llmgw_router_limit_rejections_total{kind="rpm"} 1.0' in client.metrics()


def test_the_tightest_limit_wins(acme, limited_router):
    away_from_a_minute_boundary()
    llmgw("limits", "set", "--user", "ada", "--rpm", "100", "--store")
    llmgw("limits", "set", "--org", "acme", "--rpm", "2", "--store")
    client = limited_router(acme["secret"])
    assert [client.chat().status_code for _ in range(3)] == [200, 200, 429]
    assert client.chat().headers["x-ratelimit-limit-requests"] == "2"


@pytest.mark.parametrize("scope", LEVELS)
def test_a_tpm_limit_at_each_level_counts_what_requests_used_not_what_they_reserved(
    acme, limited_router, scope
):
    away_from_a_minute_boundary()
    # Room for one reservation, and then for a second only if the first gave back what
    # it did not use.
    llmgw("limits", "set", f"--{scope}", subject_of(acme, scope), "--tpm",
          str(reservation(CHAT) + USED), "--store")  # fmt: skip
    client = limited_router(acme["secret"])
    assert [client.chat().status_code for _ in range(2)] == [200, 200]
    third = client.chat()
    assert third.status_code == 429 and third.json()["error"]["type"] == "tokens"
    assert third.headers["x-ratelimit-limit-tokens"] == str(reservation(CHAT) + USED)
    assert int(third.headers["x-ratelimit-remaining-tokens"]) < reservation(CHAT)


@pytest.mark.parametrize("scope", LEVELS)
def test_a_concurrency_limit_at_each_level_refuses_a_request_while_others_are_in_flight(
    acme, limited_router, engine, scope
):
    subject = subject_of(acme, scope)
    llmgw("limits", "set", f"--{scope}", subject, "--concurrent", "2", "--store")
    client = limited_router(acme["secret"])
    engine.control(first_delay_s=3.0)
    slow = [threading.Thread(target=client.chat) for _ in range(2)]
    for t in slow:
        t.start()
    eventually(lambda: engine.stats()["active"] == 2, what="two requests in flight")
    refused = client.chat()
    assert refused.status_code == 429
    assert f"concurrent requests on {scope} '{subject}'" in refused.json()["error"]["message"]
    for t in slow:
        t.join()
    engine.control(first_delay_s=0.0)
    assert client.chat().status_code == 200


@pytest.mark.parametrize("scope,period", [(s, p) for s in LEVELS for p in ("day", "month")])
def test_a_spent_token_budget_at_each_level_answers_insufficient_quota_not_to_be_retried(
    acme, limited_router, scope, period
):
    llmgw("budgets", "set", f"--{scope}", subject_of(acme, scope), "--period", period,
          "--tokens", str(budget_reservation(CHAT) + USED - 1), "--store")  # fmt: skip
    client = limited_router(acme["secret"])
    assert client.chat().status_code == 200
    spent = client.chat()
    assert spent.status_code == 429
    assert spent.json()["error"]["code"] == "insufficient_quota"
    assert spent.json()["error"]["type"] == "insufficient_quota"
    assert spent.headers["x-should-retry"] == "false"
    assert "Retry-After" not in spent.headers
    (budget,) = ctl("budgets", "list")
    assert budget["used"]["tokens"] <= budget["tokens"]


PRICED = """
[[models]]
name = "m"
source = "/models/m.gguf"
[models.pricing]
input_per_mtok = 1000.0
output_per_mtok = 2000.0
"""


@pytest.mark.parametrize("scope,period", [("org", "month"), ("user", "day"), ("key", "month"),
                                          ("project", "day"), ("team", "month")])  # fmt: skip
def test_a_cost_budget_at_each_level_counts_at_the_models_prices(
    acme, limited_router, scope, period
):
    reserved = len(json.dumps(CHAT)) * 1000 + CHAT["max_tokens"] * 2000
    used = 7 * 1000 + 5 * 2000  # millionths: 0.017 a request
    llmgw("budgets", "set", f"--{scope}", subject_of(acme, scope), "--period", period,
          "--cost", str((reserved + used - 1) / 1e6), "--store")  # fmt: skip
    client = limited_router(acme["secret"], extra=PRICED)
    assert client.chat().status_code == 200
    assert client.chat().json()["error"]["code"] == "insufficient_quota"
    rows = eventually(lambda: ctl("usage", "--by", "org"), what="usage rows")
    (org,) = rows
    assert org["org"] == "acme" and org["requests"] == 2
    assert org["cost"] == pytest.approx(0.017)


def test_many_concurrent_requests_on_the_last_of_a_budget_cannot_all_take_it(
    acme, limited_router, engine
):
    fits = 4
    llmgw("budgets", "set", "--user", "ada", "--period", "day", "--tokens",
          str(fits * budget_reservation(CHAT)), "--store")  # fmt: skip
    client = limited_router(acme["secret"])
    engine.control(first_delay_s=2.0)  # all of them are in flight at once
    statuses = []

    def ask():
        statuses.append(client.chat().status_code)

    threads = [threading.Thread(target=ask) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses) == [200] * fits + [429] * (24 - fits)
    (budget,) = ctl("budgets", "list")
    assert budget["used"]["tokens"] <= fits * budget_reservation(CHAT)


def test_every_answer_to_a_limited_key_carries_the_rate_limit_headers(acme, limited_router):
    llmgw("limits", "set", "--key", acme["id"], "--rpm", "1000", "--tpm", "1000000", "--store")
    client = limited_router(acme["secret"])
    ok = client.chat()
    missing = client.chat({**CHAT, "model": "nope"})
    assert (ok.status_code, missing.status_code) == (200, 404)
    for resp in (ok, missing):
        for unit in ("requests", "tokens"):
            for what in ("limit", "remaining", "reset"):
                assert f"x-ratelimit-{what}-{unit}" in resp.headers, (resp.status_code, unit)
    assert ok.headers["x-ratelimit-limit-tokens"] == "1000000"


def test_a_request_without_max_tokens_is_bounded_while_a_token_limit_applies(
    acme, limited_router, engine
):
    llmgw("limits", "set", "--user", "ada", "--tpm", "100000", "--store")
    client = limited_router(acme["secret"], extra="default_max_tokens = 77\n")
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    assert client.chat(body).status_code == 200
    assert engine.stats()["last_body"]["max_tokens"] == 77


def test_a_key_without_limits_is_served_as_before_and_usage_names_who_used_it(acme, limited_router):
    client = limited_router(acme["secret"])
    resp = client.chat()
    assert resp.status_code == 200 and "x-ratelimit-limit-requests" not in resp.headers
    rows = eventually(lambda: ctl("usage", "--by", "team"), what="usage rows")
    assert [(r["team"], r["requests"], r["prompt_tokens"]) for r in rows] == [("research", 1, 7)]
    by_key = ctl("usage", "--by", "key")
    assert [r["key"] for r in by_key] == [acme["id"]]
    csv = llmgw("usage", "--by", "user", "--csv", "--store").stdout.splitlines()
    assert csv[0] == "user,requests,errors,prompt_tokens,completion_tokens,cost"
    assert csv[1].startswith("ada,1,0,7,5,")


UNPRICED = """
[[models]]
name = "m"
source = "/models/m.gguf"
"""


def test_a_cost_budget_refuses_a_model_without_prices_rather_than_count_it_free(
    acme, limited_router, engine
):
    llmgw("budgets", "set", "--org", "acme", "--period", "month", "--cost", "5", "--store")
    client = limited_router(acme["secret"], extra=UNPRICED)
    resp = client.chat()
    assert resp.status_code == 403
    err = resp.json()["error"]
    assert err["code"] == "model_not_priced" and err["param"] == "model"
    assert "'m' has no prices" in err["message"]
    assert "cost/month budget on org 'acme'" in err["message"]
    assert resp.headers["x-should-retry"] == "false"
    assert engine.stats()["requests"] == 0
    # Without a cost budget the same model is served: only what cannot be counted is refused.
    llmgw("budgets", "remove", "--org", "acme", "--period", "month", "--store")
    eventually(lambda: client.chat().status_code == 200, what="the budget's removal to apply")
