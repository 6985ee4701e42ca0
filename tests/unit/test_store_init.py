"""`llmgw store init --admin-url`: a role and a database on a real PostgreSQL, migrated."""

import os
import uuid
from urllib.parse import urlparse

import psycopg2
import pytest

from llmgw.store import migrations, open_store, pending
from tests.conftest import postgres_or_skip
from tests.helpers import llmgw


@pytest.fixture
def name():
    admin = postgres_or_skip()
    n = "llmgw_init_" + uuid.uuid4().hex[:8]
    yield n
    conn = psycopg2.connect(admin)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {n} WITH (FORCE)")
        cur.execute(f"DROP ROLE IF EXISTS {n}")
    conn.close()


def test_store_init_makes_a_role_and_a_migrated_database_and_prints_its_url(name, tmp_path):
    admin = postgres_or_skip()
    pgpass = tmp_path / "pgpass"
    result = llmgw("store", "init", "--admin-url", admin, "--name", name, "--pgpass", str(pgpass))
    url = result.stdout.strip()
    assert url.startswith(f"postgresql://{name}@") and url.endswith(f"/{name}")
    line = pgpass.read_text().strip()
    where = urlparse(admin)
    assert line.startswith(f"{where.hostname}:{where.port or 5432}:{name}:{name}:")
    assert line.split(":")[-1] not in url  # the password is in the file only
    assert oct(pgpass.stat().st_mode & 0o777) == "0o600"
    os.environ["PGPASSFILE"] = str(pgpass)
    try:
        db = open_store(url)
        assert pending(db) == []
        with db.cursor() as cur:
            cur.execute("SELECT current_user, count(*) FROM llmgw_migrations GROUP BY 1")
            assert cur.fetchone() == (name, len(migrations.MIGRATIONS))
        db.close()
    finally:
        del os.environ["PGPASSFILE"]

    again = llmgw("store", "init", "--admin-url", admin, "--name", name, "--pgpass",
                  str(pgpass), check=False)  # fmt: skip
    assert again.returncode == 1
    (err,) = again.stderr.strip().splitlines()
    assert "exists already" in err and url in err
