"""Usage reports and the daily rollup, on SQLite and a real PostgreSQL: reports add up
the same before and after raw rows are rolled up and pruned."""

import pytest

from llmgw import usage
from llmgw.store import StoredResponse, Usage, migrate, open_store
from llmgw.store.tenancy import UsageDaily

DAY = 86400
NOW = 1_800_000_000.0 + 12 * 3600  # noon, UTC


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def row(at, user="ada", org="acme", model="big", served="small", status=200, p=10, c=5, cost=0.5):
    Usage.create(at=at, request_id="r", key_id="key_1", model=model, served_model=served,
                 endpoint="e", prompt_tokens=p, completion_tokens=c, status=status,
                 latency_ms=1.0, user=user, project=None, team=None, org=org,
                 cost=cost)  # fmt: skip


def test_rollup_keeps_reports_whole_while_pruning_raw_rows_past_the_retention(db):
    for days_ago in (5, 3, 3, 1, 0):
        row(NOW - days_ago * DAY)
    row(NOW - 3 * DAY, user="bob", status=429, p=0, c=0, cost=0.0)
    before = {by: usage.report(by, NOW - 7 * DAY, NOW) for by in usage.BY}

    done = usage.rollup(NOW, retention_days=2)
    assert done["days_rolled_up"] == 3  # 5, 3 and 1 days ago; today is not over
    assert done["raw_rows_pruned"] == 4  # the rows of 5 and 3 days ago
    assert Usage.select().count() == 2
    for by in usage.BY:
        assert usage.report(by, NOW - 7 * DAY, NOW) == before[by], by
    (ada,) = [r for r in before["user"] if r["user"] == "ada"]
    assert (ada["requests"], ada["prompt_tokens"], ada["cost"]) == (5, 50, 2.5)
    (bob,) = [r for r in before["user"] if r["user"] == "bob"]
    assert (bob["requests"], bob["errors"]) == (1, 1)
    assert [r["model"] for r in before["model"]] == ["small"], "the model that answered"

    again = usage.rollup(NOW, retention_days=2)
    assert again == {"days_rolled_up": 0, "rollup_rows": 0, "raw_rows_pruned": 0,
                     "responses_pruned": 0}  # fmt: skip
    assert usage.report("org", NOW - 7 * DAY, NOW) == before["org"]


def test_rows_that_arrive_late_for_a_rolled_up_day_are_added_by_the_next_run(db):
    row(NOW - 3 * DAY)
    usage.rollup(NOW, retention_days=2)
    row(NOW - 3 * DAY + 60)  # a router that buffered through a store outage
    usage.rollup(NOW, retention_days=2)
    assert Usage.select().count() == 0
    (acme,) = usage.report("org", NOW - 7 * DAY, NOW)
    assert acme["requests"] == 2
    assert UsageDaily.select().count() == 2


def test_a_report_counts_rolled_up_days_whole_and_raw_rows_exactly(db):
    row(NOW - 3 * DAY)
    row(NOW - 1)  # earlier today
    usage.rollup(NOW, retention_days=0)  # 0: roll up, prune nothing
    assert Usage.select().count() == 2
    assert usage.report("user", NOW - 2, NOW)[0]["requests"] == 1
    (ada,) = usage.report("user", NOW - 3 * DAY + 3600, NOW)
    assert ada["requests"] == 2, "the rolled-up day is counted whole"
    with pytest.raises(ValueError):
        usage.report("color", 0, NOW)


def test_rollup_prunes_stored_responses_past_the_retention_and_keeps_the_rest(db):
    for rid, days_ago in (("resp_old", 3), ("resp_new", 1)):
        StoredResponse.create(id=rid, key_id="key_1", created_at=NOW - days_ago * DAY,
                              model="m", input="[]", context="[]", body="{}")  # fmt: skip
    assert usage.rollup(NOW, retention_days=2)["responses_pruned"] == 1
    assert [r.id for r in StoredResponse.select()] == ["resp_new"]
    assert usage.rollup(NOW, retention_days=0)["responses_pruned"] == 0


def test_rollup_prunes_a_conversation_whole_once_its_last_response_is_old(db):
    """Each response is a link its later ones are rebuilt through: an old first turn of
    a conversation still going on stays."""
    for rid, prev, days_ago in (("old_0", None, 9), ("old_1", "old_0", 8), ("old_2", "old_1", 7),
                                ("live_0", None, 9), ("live_1", "live_0", 5),
                                ("live_2", "live_1", 1)):  # fmt: skip
        StoredResponse.create(id=rid, key_id="key_1", created_at=NOW - days_ago * DAY,
                              model="m", previous_id=prev, input="[]", context="[]",
                              body="{}")  # fmt: skip
    assert usage.rollup(NOW, retention_days=2)["responses_pruned"] == 3
    assert sorted(r.id for r in StoredResponse.select()) == ["live_0", "live_1", "live_2"]
