import json
import os
import uuid

import pytest

from tests.helpers import llmgw


@pytest.fixture(autouse=True)
def isolated_paths(tmp_path, monkeypatch):
    """Point every llmgw path at a temporary directory: no test touches the machine."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "llmgw.toml").write_text(
        f'[paths]\nconfig_dir = "{etc}"\nstate_dir = "{tmp_path / "state"}"\n'
        f'backup_dir = "{tmp_path / "backups"}"\n'
    )
    monkeypatch.setenv("LLMGW_CONFIG", str(etc / "llmgw.toml"))
    monkeypatch.setenv("LLMGW_STORE", f"sqlite://{tmp_path}/llmgw.db")
    # `llmgw login`'s tokens (tools/ctl/logins.py): never the person's own.
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    return tmp_path


POSTGRES = os.environ.get("LLMGW_TEST_POSTGRES")  # e.g. postgresql://postgres@127.0.0.1/postgres


def postgres_or_skip() -> str:
    """The server's admin URL; skip without one, except in CI, where it must be there."""
    if not POSTGRES:
        if os.environ.get("CI"):
            pytest.fail("CI must set LLMGW_TEST_POSTGRES: PostgreSQL tests may not skip")
        pytest.skip("LLMGW_TEST_POSTGRES is not set")
    return POSTGRES


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path, monkeypatch):
    """A fresh, empty store of each kind. PostgreSQL is never skipped in CI."""
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path}/store.db"
    else:
        url = _fresh_pg_database(postgres_or_skip())
    monkeypatch.setenv("LLMGW_STORE", url)
    yield url
    if request.param == "postgresql":
        _drop_pg_database(POSTGRES, url)


@pytest.fixture
def pg_store(monkeypatch):
    """Every process a test starts on one fresh PostgreSQL database (LLMGW_STORE)."""
    url = _fresh_pg_database(postgres_or_skip())
    monkeypatch.setenv("LLMGW_STORE", url)
    yield url
    _drop_pg_database(POSTGRES, url)


def _fresh_pg_database(admin_url: str) -> str:
    import psycopg2

    name = "llmgw_test_" + uuid.uuid4().hex[:10]
    conn = psycopg2.connect(admin_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {name}")
    conn.close()
    base = admin_url.rsplit("/", 1)[0]
    return f"{base}/{name}"


def _drop_pg_database(admin_url: str, url: str) -> None:
    import psycopg2

    from llmgw.store import db_proxy

    if db_proxy.obj is not None:
        db_proxy.obj.close()
    conn = psycopg2.connect(admin_url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")
    conn.close()


@pytest.fixture
def api_key():
    """A fresh API key for every model, made with the real CLI: (id, secret)."""
    out = json.loads(llmgw("keys", "create", "--store", "--name", "test", "--json").stdout)
    return out["id"], out["secret"]
