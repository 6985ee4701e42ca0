"""Migrations spell out their own DDL, so the schema a store ends up with depends only on
the migrations it ran: a fresh store matches the checked-in snapshot, and a store saved
at m006 (tests/fixtures) upgrades to exactly the schema of a fresh one, on SQLite and on
a real PostgreSQL."""

import json
import shutil
from pathlib import Path

import peewee
import psycopg2
import pytest

from llmgw.store import (
    ALL_MODELS,
    ApiKey,
    AuditEntry,
    Usage,
    migrate,
    migrations,
    open_store,
    pending,
)
from llmgw.store.migrations import MIGRATIONS
from llmgw.store.tenancy import TABLES
from tests.conftest import POSTGRES, _drop_pg_database, _fresh_pg_database
from tests.store_schema import SNAPSHOT, describe, fresh

FIXTURES = Path(__file__).parent.parent / "fixtures"
AFTER_M006 = [m.__name__ for m in MIGRATIONS[6:]]


def backend(url: str) -> str:
    return "sqlite" if url.startswith("sqlite") else "postgresql"


def restore_m006(url: str) -> None:
    """Put the store saved at m006 at `url` (an empty store)."""
    if backend(url) == "sqlite":
        shutil.copyfile(FIXTURES / "store_m006.sqlite3", url.removeprefix("sqlite://"))
        return
    conn = psycopg2.connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute((FIXTURES / "store_m006.postgresql.sql").read_text())
    conn.close()


@pytest.fixture
def another_fresh_url(store_url, tmp_path):
    """A second empty store of the same kind as `store_url`."""
    if backend(store_url) == "sqlite":
        yield f"sqlite://{tmp_path}/fresh.db"
        return
    url = _fresh_pg_database(POSTGRES)
    yield url
    _drop_pg_database(POSTGRES, url)


def test_a_fresh_store_has_exactly_the_schema_in_the_snapshot(store_url):
    expected = json.loads(SNAPSHOT.read_text())[backend(store_url)]
    assert fresh(store_url) == expected


def test_a_store_saved_at_m006_upgrades_to_the_schema_of_a_fresh_one(store_url, another_fresh_url):
    restore_m006(store_url)
    db = open_store(store_url)
    saved = describe(db)
    assert pending(db) == AFTER_M006
    assert migrate(db) == AFTER_M006
    upgraded = describe(db)
    db.close()
    assert upgraded != saved  # the fixture really is the old schema
    assert upgraded == fresh(another_fresh_url)


def test_rows_saved_at_m006_are_kept_and_get_the_new_columns_defaults(store_url):
    restore_m006(store_url)
    db = open_store(store_url)
    migrate(db)
    key = ApiKey.get_by_id("key_m006")
    assert (key.name, key.user, key.project, key.band) == ("made at m006", None, None, "")
    (row,) = Usage.select()
    assert (row.id, row.request_id, row.completion_tokens) == (1, "req_m006", 7)
    assert (row.user, row.org, row.cost) == (None, None, None)
    assert AuditEntry.get().action == "keys.create"
    # The id sequences carry on from the saved rows rather than colliding with them.
    new = AuditEntry.create(at=1.0, actor="a", client="local", action="x")
    assert new.id == 2
    db.close()


def test_migrating_twice_changes_nothing(store_url):
    db = open_store(store_url)
    assert migrate(db) == [m.__name__ for m in MIGRATIONS]
    once = describe(db)
    assert migrate(db) == []
    assert pending(db) == []
    assert describe(db) == once
    db.close()


def test_every_model_field_is_a_column_of_its_table_with_the_same_nullability(store_url):
    tables = fresh(store_url)["tables"]
    for model in ALL_MODELS + TABLES:
        columns = tables[model._meta.table_name]["columns"]
        fields = {f.column_name: f for f in model._meta.sorted_fields}
        assert set(columns) == set(fields), model.__name__
        for name, field in fields.items():
            assert ("NOT NULL" in columns[name]) == (not field.null), f"{model.__name__}.{name}"


def test_the_migrations_never_touch_the_query_models():
    """The DDL is written out in migrations.py: editing a model cannot change what an
    old migration creates."""
    text = Path(migrations.__file__).read_text()
    assert "create_tables" not in text
    assert "llmgw.store.models" not in text and "llmgw.store import" not in text


def test_a_migration_that_fails_leaves_nothing_half_applied(store_url, monkeypatch):
    def m999_broken(db):
        migrations.run(
            db,
            "CREATE TABLE half_made (id INTEGER)",
            "ALTER TABLE api_keys ADD COLUMN half_added INTEGER",
            "SELECT * FROM no_such_table",
        )

    monkeypatch.setattr(migrations, "MIGRATIONS", [*MIGRATIONS, m999_broken])
    db = open_store(store_url)
    with pytest.raises(peewee.DatabaseError, match="no_such_table"):
        migrate(db)
    assert pending(db) == ["m999_broken"]
    tables = describe(db)["tables"]
    assert "half_made" not in tables
    assert "half_added" not in tables["api_keys"]["columns"]
    db.close()
