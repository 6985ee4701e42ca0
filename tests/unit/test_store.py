"""The store against both SQLite and a real PostgreSQL."""

import time

import pytest

from llmgw import apikeys
from llmgw.errors import StoreError
from llmgw.store import ApiKey, Usage, database_for, migrate, open_store, pending, redact
from llmgw.store.migrations import MIGRATIONS
from llmgw_router.keycache import KeyCache
from llmgw_router.usage import UsageRow, UsageWriter

# A usage row's attribution and cost, for a key that belongs to nobody.


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def test_migrations_apply_from_a_blank_database_and_are_recorded(store_url):
    db = open_store(store_url)
    assert pending(db) == [m.__name__ for m in MIGRATIONS]
    assert migrate(db) == [m.__name__ for m in MIGRATIONS]
    assert pending(db) == []
    assert migrate(db) == []  # a second run applies nothing
    assert ApiKey.select().count() == 0
    db.close()


def test_a_key_is_stored_only_as_a_hash(db):
    row, secret = apikeys.create("ci", ["m"], expires_in=None)
    stored = ApiKey.get_by_id(row.id)
    assert stored.secret_hash == apikeys.hash_secret(secret)
    values = [str(v) for v in stored.__data__.values()]
    assert secret not in values
    assert stored.model_list == ["m"]


def test_the_key_cache_sees_new_and_revoked_keys_incrementally(db):
    cache = KeyCache()
    row, secret = apikeys.create("a", [], expires_in=None)
    cache.refresh()
    assert cache.lookup(secret).id == row.id
    assert cache.lookup(secret).allows("anything")
    now = time.time() + 1
    ApiKey.update(revoked_at=now, updated_at=now).where(ApiKey.id == row.id).execute()
    other, other_secret = apikeys.create("b", ["m"], expires_in=None)
    cache.refresh()
    assert cache.lookup(secret) is None
    assert cache.lookup(other_secret).allows("m")
    assert not cache.lookup(other_secret).allows("n")


def test_usage_rows_are_written_in_batches(db):
    writer = UsageWriter(db, capacity=100, batch=3)
    for i in range(7):
        writer.record(UsageRow(time.time(), f"r{i}", "key_x", "m", served_model="m", endpoint="e",
                               prompt_tokens=5, completion_tokens=7, status=200,
                               latency_ms=12.5, ttft_ms=3.0))  # fmt: skip
    assert writer.flush() == 7
    rows = list(Usage.select().order_by(Usage.request_id))
    assert [r.request_id for r in rows] == [f"r{i}" for i in range(7)]
    assert rows[0].completion_tokens == 7 and rows[0].ttft_ms == 3.0


def test_a_full_usage_buffer_drops_and_counts_instead_of_growing(db):
    dropped = []
    writer = UsageWriter(db, capacity=2, on_drop=dropped.append)
    for i in range(5):
        writer.record(UsageRow(time.time(), f"r{i}", None, "m", status=401, latency_ms=1.0))
    assert writer.pending() == 2
    assert sum(dropped) == 3


def test_rows_survive_a_failed_write_and_are_written_on_the_next_try(db, monkeypatch):
    writer = UsageWriter(db, capacity=10)
    writer.record(UsageRow(time.time(), "r1", None, "m", status=200, latency_ms=1.0))
    good_sql = writer._sql
    writer._sql = good_sql.replace("INSERT INTO usage", "INSERT INTO no_such_table")
    with pytest.raises(Exception, match="no_such_table"):
        writer.flush()
    assert writer.pending() == 1
    writer._sql = good_sql
    assert writer.flush() == 1
    assert Usage.select().count() == 1


def test_a_store_url_with_an_unknown_scheme_is_refused():
    with pytest.raises(StoreError, match="scheme must be sqlite or postgresql"):
        database_for("mysql://db/llmgw")


def test_a_postgres_url_must_name_the_database():
    with pytest.raises(StoreError, match="name the database"):
        database_for("postgresql://db1")


def test_an_unreachable_store_is_one_clear_error():
    with pytest.raises(
        StoreError, match="cannot open store postgresql://u:\\*\\*\\*@127.0.0.1:1/x"
    ):
        open_store("postgresql://u:pw@127.0.0.1:1/x")


def test_passwords_are_redacted_from_urls_in_messages():
    assert redact("postgresql://u:hunter2@db/x") == "postgresql://u:***@db/x"
