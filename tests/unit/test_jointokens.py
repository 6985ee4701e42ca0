"""Join tokens on each store: once, until they expire, and only their hash kept."""

import threading

import pytest

from llmgw import jointokens
from llmgw.errors import Invalid
from llmgw.store import JoinToken, migrate, open_store


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    return db


def test_a_token_works_once_and_only_its_hash_is_kept(db):
    row, token = jointokens.create("gpu-07", 3600, now=1000.0)
    assert token.startswith(jointokens.PREFIX) and token not in str(
        list(JoinToken.select().dicts())
    )
    used = jointokens.redeem(token, now=1001.0, client="10.0.0.7")
    assert (used.node, used.used_at, used.used_from) == ("gpu-07", 1001.0, "10.0.0.7")
    with pytest.raises(jointokens.TokenRefused, match="used already \\(from 10.0.0.7\\)") as e:
        jointokens.redeem(token, now=1002.0, client="10.0.0.8")
    assert e.value.code == "join_token_used"


def test_a_token_past_its_time_is_refused_as_expired_and_stays_unused(db):
    _, token = jointokens.create("gpu-07", 60, now=1000.0)
    with pytest.raises(jointokens.TokenRefused, match="expired"):
        jointokens.redeem(token, now=1060.0, client="x")
    assert JoinToken.get().used_at is None


def test_an_unknown_token_is_refused(db):
    with pytest.raises(jointokens.TokenRefused, match="not a join token"):
        jointokens.redeem("llmgw-join-nope", now=1.0, client="x")


def test_two_nodes_racing_with_one_token_cannot_both_join(db):
    _, token = jointokens.create("gpu-07", 3600, now=1000.0)
    results = []

    def attempt():
        try:
            results.append(jointokens.redeem(token, now=1001.0, client="x").node)
        except jointokens.TokenRefused as e:
            results.append(e.code)
        finally:
            db.close()

    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["gpu-07"] + ["join_token_used"] * 3


def test_a_fingerprint_may_have_colons_and_capitals_but_must_be_a_sha256():
    fp = "AB:" * 31 + "AB"
    assert jointokens.normal_fingerprint(fp) == "ab" * 32
    with pytest.raises(Invalid, match="64 hex digits"):
        jointokens.normal_fingerprint("abc")


def test_a_ttl_is_bounded(db):
    with pytest.raises(Invalid):
        jointokens.create("gpu-07", 0, now=1.0)
    with pytest.raises(Invalid):
        jointokens.create("gpu-07", 30 * 86400, now=1.0)
