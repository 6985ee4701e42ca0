"""The store's schema as plain data, read back from the database's own catalog, so a
fresh store, an upgraded one and the checked-in snapshot can be compared.

What differs harmlessly is left out: column order (every query names its columns), the
names SQLite gives the indexes behind a composite primary key, and the SQL text SQLite
keeps for each table (rewritten when a table is rebuilt). Types, nullability,
defaults, primary keys, indexes with their columns and uniqueness, constraints and
sequences are all kept.

    .venv/bin/python -m tests.store_schema    # rewrite tests/fixtures/store_schema.json

after adding a migration (needs LLMGW_TEST_POSTGRES), and review the diff.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

import peewee

SNAPSHOT = Path(__file__).parent / "fixtures" / "store_schema.json"


def describe(db: peewee.Database) -> dict:
    """{table: {columns, primary_key, indexes, ...}} for every table in the store."""
    if isinstance(db, peewee.SqliteDatabase):
        return _sqlite(db)
    return _postgres(db)


def _sqlite(db: peewee.SqliteDatabase) -> dict:
    tables = [
        name
        for (name,) in db.execute_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table' "
            "AND name NOT LIKE 'sqlite_stat%' ORDER BY name"
        )
    ]
    out = {}
    for table in tables:
        info = list(db.execute_sql(f'PRAGMA table_info("{table}")'))
        columns = {
            name: _column(type_, bool(notnull), default)
            for _cid, name, type_, notnull, default, _pk in info
        }
        primary_key = [row[1] for row in sorted(info, key=lambda r: r[5]) if row[5]]
        indexes = {}
        for _seq, name, unique, origin, _partial in db.execute_sql(f'PRAGMA index_list("{table}")'):
            cols = [row[2] for row in db.execute_sql(f'PRAGMA index_info("{name}")')]
            if name.startswith("sqlite_autoindex_"):
                # SQLite numbers these itself; what matters is what they enforce.
                name = f"({origin}) " + ",".join(cols)
            indexes[name] = ("UNIQUE " if unique else "") + "(" + ", ".join(cols) + ")"
        foreign_keys = [
            [row[3], row[2], row[4]]
            for row in db.execute_sql(f'PRAGMA foreign_key_list("{table}")')
        ]
        out[table] = {
            "columns": columns,
            "primary_key": primary_key,
            "indexes": indexes,
            "foreign_keys": foreign_keys,
        }
    return {"tables": out}


def _postgres(db: peewee.PostgresqlDatabase) -> dict:
    tables = [
        name
        for (name,) in db.execute_sql(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = 'public' AND table_type = 'BASE TABLE' ORDER BY 1"
        )
    ]
    out = {}
    for table in tables:
        columns = {
            name: _column(data_type + (f"({length})" if length else ""), nullable == "NO", default)
            for name, data_type, length, nullable, default in db.execute_sql(
                "SELECT column_name, data_type, character_maximum_length, is_nullable, "
                "column_default FROM information_schema.columns "
                "WHERE table_schema = 'public' AND table_name = %s",
                (table,),
            )
        }
        constraints = dict(
            db.execute_sql(
                "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = %s::regclass",
                (f'public."{table}"',),
            )
        )
        primary_key = [
            name
            for (name,) in db.execute_sql(
                "SELECT a.attname FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(n, o) "
                "JOIN pg_attribute a ON a.attnum = k.n "
                "WHERE i.indrelid = %s::regclass AND i.indisprimary "
                "AND a.attrelid = i.indrelid ORDER BY k.o",
                (f'public."{table}"',),
            )
        ]
        indexes = dict(
            db.execute_sql(
                "SELECT indexname, indexdef FROM pg_indexes "
                "WHERE schemaname = 'public' AND tablename = %s",
                (table,),
            )
        )
        out[table] = {
            "columns": columns,
            "primary_key": primary_key,
            "indexes": indexes,
            "constraints": constraints,
        }
    sequences = {
        name: f"{type_} START {start} INCREMENT {increment} OWNED BY {owner}"
        for name, type_, start, increment, owner in db.execute_sql(
            "SELECT s.sequencename, s.data_type::text, s.start_value, s.increment_by, "
            "(SELECT d.refobjid::regclass::text || '.' || a.attname FROM pg_depend d "
            " JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            " WHERE d.objid = (quote_ident(s.schemaname) || '.' || "
            " quote_ident(s.sequencename))::regclass AND d.deptype = 'a') "
            "FROM pg_sequences s WHERE s.schemaname = 'public'"
        )
    }
    return {"tables": out, "sequences": sequences}


def _column(type_: str, not_null: bool, default: str | None) -> str:
    """One column as one line, e.g. "VARCHAR(32) NOT NULL", for a readable snapshot."""
    return type_ + (" NOT NULL" if not_null else "") + (f" DEFAULT {default}" if default else "")


def fresh(url: str) -> dict:
    """The schema of a store at `url` (empty) migrated to head."""
    from llmgw.store import migrate, open_store

    db = open_store(url)
    try:
        migrate(db)
        return describe(db)
    finally:
        db.close()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from tests.conftest import POSTGRES, _drop_pg_database, _fresh_pg_database

    if not POSTGRES:
        sys.exit("store_schema: set LLMGW_TEST_POSTGRES to snapshot both backends")
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = fresh(f"sqlite://{tmp}/store.db")
    url = _fresh_pg_database(POSTGRES)
    try:
        postgresql = fresh(url)
    finally:
        _drop_pg_database(POSTGRES, url)
    snapshot = {"sqlite": sqlite, "postgresql": postgresql}
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    print(f"wrote {os.path.relpath(SNAPSHOT)}")


if __name__ == "__main__":
    main()
