"""Stored responses: found at once by the router that made them, through the store by
any other, only by the key that made them, and gone once deleted."""

import asyncio

import peewee
import pytest

from llmgw.store import StoredResponse, migrate, migrations, open_store
from llmgw_router.conversations import Conversations, Saved


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def saved(rid: str, key: str = "key_a") -> Saved:
    return Saved(rid, key, 1.0, "m", None, [{"type": "message", "role": "user",
                 "content": "hi"}], [], {"id": rid, "output": []})  # fmt: skip


def get(convs: Conversations, rid: str, key: str = "key_a"):
    return asyncio.run(convs.get(rid, key))


def test_a_response_is_found_before_the_store_has_it_and_by_another_router_after(db):
    mine, other = Conversations(db), Conversations(db)
    mine.put(saved("resp_1"))
    assert get(mine, "resp_1").input[0]["content"] == "hi"
    assert StoredResponse.select().count() == 0 and get(other, "resp_1") is None
    mine._tick()
    assert get(other, "resp_1").body == {"id": "resp_1", "output": []}


def test_another_keys_response_is_not_found(db):
    mine = Conversations(db)
    mine.put(saved("resp_1"))
    mine._tick()
    assert get(mine, "resp_1", "key_b") is None
    assert get(Conversations(db), "resp_1", "key_b") is None


def test_a_deleted_response_is_gone_at_once_and_from_the_store(db):
    mine = Conversations(db)
    mine.put(saved("resp_1"))
    mine._tick()
    mine.delete("resp_1")
    assert get(mine, "resp_1") is None  # the store still has it: the tombstone answers
    mine._tick()
    assert StoredResponse.select().count() == 0 and get(mine, "resp_1") is None


def test_the_cache_is_bounded_and_what_left_it_is_read_from_the_store(db):
    mine = Conversations(db, cache_size=2)
    for i in range(3):
        mine.put(saved(f"resp_{i}"))
    assert list(mine._cache) == ["resp_1", "resp_2"]
    mine._tick()
    assert get(mine, "resp_0").id == "resp_0"


def test_writes_the_store_refused_are_kept_in_order_for_the_next_try(db):
    mine = Conversations(db)
    mine.put(saved("resp_1"))
    mine.delete("resp_1")
    mine.put(saved("resp_2"))
    db.execute_sql("DROP TABLE responses")  # a store that refuses every write
    with pytest.raises(peewee.DatabaseError):
        mine._tick()
    assert mine.pending() == 3
    migrations.m015_responses(db)  # the table back, as m015 made it
    mine._tick()
    assert [r.id for r in StoredResponse.select()] == ["resp_2"]
