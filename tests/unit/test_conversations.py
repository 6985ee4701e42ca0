"""Stored responses: found at once by the router that made them, through the store by
any other, only by the key that made them, and gone once deleted; a conversation as a
chain of responses, each with its own turn, walked back within a bound; and stores made
before the chain (m015) converted by m016 with their conversations intact."""

import asyncio
import json

import peewee
import pytest

from llmgw.store import StoredResponse, migrate, migrations, open_store
from llmgw_router.conversations import Conversations, Saved
from llmgw_router.errors import ChainBroken, ChainTooLong
from llmgw_router.responses_api import conversation


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def saved(rid: str, key: str = "key_a", prev: str | None = None) -> Saved:
    return Saved(rid, key, 1.0, "m", prev, [{"type": "message", "role": "user",
                 "content": "hi"}], [], {"id": rid, "output": []})  # fmt: skip


def turn(rid: str, prev: str | None) -> Saved:
    """A response whose input and answer name it."""
    said = [{"type": "message", "role": "user", "content": f"to {rid}"}]
    out = [{"type": "message", "content": [{"type": "output_text", "text": f"from {rid}"}]}]
    return Saved(rid, "key_a", 1.0, "m", prev, said, [], {"id": rid, "output": out})


def conversation_of(convs: Conversations, n: int) -> list[str]:
    """Responses r0..r{n-1}, each continuing the one before."""
    for i in range(n):
        convs.put(turn(f"r{i}", f"r{i - 1}" if i else None))
    return [f"r{i}" for i in range(n)]


def chain(convs: Conversations, rid: str, most: int = 100, key: str = "key_a"):
    return asyncio.run(convs.chain(rid, key, most))


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


def test_a_continuation_walks_the_chain_from_the_cache_and_the_store_alike(db):
    mine = Conversations(db)
    ids = conversation_of(mine, 4)
    from_cache = chain(mine, "r3")
    mine._tick()
    from_store = chain(Conversations(db), "r3")  # another router: one query
    assert [s.id for s in from_cache] == [s.id for s in from_store] == ids[::-1]
    assert from_store == from_cache
    assert [i["content"] for i in conversation(from_store)] == [
        "to r0", "from r0", "to r1", "from r1", "to r2", "from r2", "to r3", "from r3",
    ]  # fmt: skip


def test_each_stored_response_keeps_its_own_turn_only(db):
    mine = Conversations(db)
    conversation_of(mine, 5)
    mine._tick()
    for row in StoredResponse.select():
        assert json.loads(row.input) == [{"type": "message", "role": "user",
                                          "content": f"to {row.id}"}]  # fmt: skip
        assert json.loads(row.context) == []


def test_a_chain_partly_out_of_the_cache_is_finished_from_the_store(db):
    mine = Conversations(db, cache_size=2)
    ids = conversation_of(mine, 5)
    mine._tick()
    assert list(mine._cache) == ["r3", "r4"]
    assert [s.id for s in chain(mine, "r4")] == ids[::-1]


def test_a_chain_longer_than_the_bound_is_refused_from_the_cache_and_the_store(db):
    mine = Conversations(db)
    conversation_of(mine, 4)
    assert len(chain(mine, "r3", most=4)) == 4
    with pytest.raises(ChainTooLong):
        chain(mine, "r3", most=3)
    mine._tick()
    other = Conversations(db)
    assert len(chain(other, "r3", most=4)) == 4
    with pytest.raises(ChainTooLong) as err:
        chain(other, "r3", most=3)
    assert (err.value.response_id, err.value.most) == ("r3", 3)


def test_a_chain_through_a_deleted_response_is_broken_and_says_where(db):
    mine = Conversations(db)
    conversation_of(mine, 3)
    mine._tick()
    mine.delete("r1")
    with pytest.raises(ChainBroken) as err:
        chain(mine, "r2")  # the tombstone answers before the store has the delete
    assert (err.value.response_id, err.value.missing) == ("r2", "r1")
    mine._tick()
    with pytest.raises(ChainBroken):
        chain(Conversations(db), "r2")
    assert [s.id for s in chain(mine, "r0")] == ["r0"]


def test_another_keys_chain_is_not_found(db):
    mine = Conversations(db)
    conversation_of(mine, 2)
    assert chain(mine, "r1", key="key_b") is None
    mine._tick()
    assert chain(Conversations(db), "r1", key="key_b") is None


# -- m016: a store of m015's copies becomes a chain ---------------------------------------


@pytest.fixture
def m015_db(store_url, monkeypatch):
    """A store migrated as far as m015, as a router of that time left it."""
    db = open_store(store_url)
    upto = migrations.MIGRATIONS.index(migrations.m015_responses) + 1
    monkeypatch.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:upto])
    migrate(db)
    monkeypatch.undo()
    yield db
    db.close()


def _old_row(db, rid, prev, context, said, answer):
    """A row as m015's router wrote it: the whole conversation before it copied in."""
    body = {"id": rid, "previous_response_id": prev, "output": [
        {"type": "message", "content": [{"type": "output_text", "text": answer}]}]}  # fmt: skip
    p = db.param
    db.execute_sql(
        "INSERT INTO responses (id, key_id, created_at, model, previous_id, input, context,"
        f" body) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})",
        (rid, "key_a", 1.0, "m", prev, json.dumps(said), json.dumps(context), json.dumps(body)),
    )
    return context + said + [{"type": "message", "role": "assistant", "content": answer}]


def test_m016_strips_copied_conversations_and_every_continuation_still_works(m015_db):
    db = m015_db
    u = [{"type": "message", "role": "user", "content": c} for c in ("a", "b", "c", "x", "y")]
    # a0 <- a1 <- a2, a conversation whose every response is stored;
    whole = {"a0": _old_row(db, "a0", None, [], [u[0]], "A0")}
    whole["a1"] = _old_row(db, "a1", "a0", whole["a0"], [u[1]], "A1")
    whole["a2"] = _old_row(db, "a2", "a1", whole["a1"], [u[2]], "A2")
    # gone <- b1 <- b2, whose first response was deleted before the upgrade.
    gone = _old_row(db, "gone", None, [], [u[3]], "G")
    whole["b1"] = _old_row(db, "b1", "gone", gone, [u[4]], "B1")
    whole["b2"] = _old_row(db, "b2", "b1", whole["b1"], [u[0]], "B2")
    db.execute_sql("DELETE FROM responses WHERE id = 'gone'")

    assert migrate(db)[0] == "m016_responses_chain"
    rows = {r.id: r for r in StoredResponse.select()}
    assert {rid: json.loads(r.context) for rid, r in rows.items()} == {
        "a0": [], "a1": [], "a2": [], "b1": gone, "b2": []}  # fmt: skip
    assert (rows["a1"].previous_id, rows["b1"].previous_id, rows["b2"].previous_id) == (
        "a0", None, "b1")  # fmt: skip
    assert json.loads(rows["b1"].body)["previous_response_id"] == "gone"
    convs = Conversations(db)
    for rid, items in whole.items():
        assert conversation(chain(convs, rid)) == items, rid


def test_a_response_an_older_router_stored_with_its_copy_ends_the_chain(db):
    """A router from before m016 still writes the whole conversation into each row:
    walking on past it would give the conversation twice."""
    mine = Conversations(db)
    conversation_of(mine, 2)
    old = turn("r2", "r1")
    old.context = conversation(chain(mine, "r1"))
    mine.put(old)
    mine.put(turn("r3", "r2"))
    mine._tick()
    expected = conversation(chain(mine, "r1")) + conversation([turn("r2", None)])
    for convs in (mine, Conversations(db)):
        assert [s.id for s in chain(convs, "r3")] == ["r3", "r2"]
        assert conversation(chain(convs, "r2")) == expected
