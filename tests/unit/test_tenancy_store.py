"""The tenancy migration and the tenancy records, on SQLite and a real PostgreSQL."""

import pytest

from llmgw.store import migrate, open_store
from llmgw.store.models import ApiKey, Migration, Usage


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def test_m007_adds_the_tenancy_columns_to_a_store_made_before_it(db):
    for table, cols in (("api_keys", ("user", "project", "band")),
                        ("usage", ("user", "project", "team", "org", "cost"))):  # fmt: skip
        for col in cols:
            db.execute_sql(f'ALTER TABLE {table} DROP COLUMN "{col}"')
    Migration.delete().where(Migration.name == "m007_tenancy").execute()

    assert migrate(db) == ["m007_tenancy"]
    assert {"user", "project", "band"} <= {c.name for c in db.get_columns("api_keys")}
    assert {"user", "org", "cost"} <= {c.name for c in db.get_columns("usage")}
    assert ApiKey.select().count() == 0 and Usage.select().count() == 0
