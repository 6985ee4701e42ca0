import json
import os
import subprocess
from pathlib import Path

import pytest

from llmgw.store import ClusterSecret, open_store
from llmgw_scheduler.main import cluster_secret
from tests.conftest import POSTGRES, _drop_pg_database, _fresh_pg_database
from tests.helpers import BIN, llmgw


def backup(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `llmgw-backup` executable."""
    return subprocess.run(
        [str(BIN / "llmgw-backup"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr
    return result


def failed_with_one_line(result: subprocess.CompletedProcess) -> str:
    """The one-line error of a run that failed, as the operator reads it."""
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    return errors[0]


def engine_secret(url: str) -> str | None:
    db = open_store(url)
    try:
        row = ClusterSecret.get_or_none(ClusterSecret.name == "engine_keys")
        return row.value if row else None
    finally:
        db.close()


@pytest.fixture
def backups(isolated_paths) -> Path:
    """The backup directory the test config names (paths.backup_dir)."""
    return isolated_paths / "backups"


@pytest.fixture
def config_dir(isolated_paths) -> Path:
    """The configuration directory, with a CA key in pki/ as llmgw-certmon leaves it."""
    etc = isolated_paths / "etc"
    (etc / "pki").mkdir(mode=0o700)
    (etc / "pki" / "ca.key").write_text("-----BEGIN PRIVATE KEY-----\nnot really\n")
    (etc / "pki" / "ca.key").chmod(0o600)
    return etc


@pytest.fixture
def seeded(store_url, config_dir) -> dict:
    """The store with an API key made by `llmgw keys create` and the engine-key secret."""
    key = json.loads(llmgw("keys", "create", "--store", "--name", "before-backup", "--json").stdout)
    db = open_store(store_url)
    try:
        secret = cluster_secret()
    finally:
        db.close()
    return {"url": store_url, "key_id": key["id"], "engine_secret": secret}


@pytest.fixture
def empty_store(store_url, tmp_path):
    """Another fresh, empty store of the same kind as `store_url`, to restore into."""
    if store_url.startswith("sqlite"):
        yield f"sqlite://{tmp_path}/restored/llmgw.db"
        return
    url = _fresh_pg_database(POSTGRES)
    yield url
    _drop_pg_database(POSTGRES, url)
