"""`llmgw store init --admin-url postgresql://…`: a role and a database for llmgw on a
PostgreSQL server, migrated, so a fleet's store is one command instead of three."""

import os
import secrets
from pathlib import Path
from urllib.parse import quote, urlparse

from llmgw.errors import StoreError
from llmgw.store import migrate, open_store


def init_postgres(admin_url: str, name: str, pgpass: Path) -> str:
    """Create role and database `name` (owned by it) with a new password, migrate it,
    and add the password to `pgpass` (0600); the store URL, without the password."""
    import psycopg2
    from psycopg2 import sql

    parsed = urlparse(admin_url)
    if parsed.scheme not in ("postgresql", "postgres"):
        raise StoreError(f"--admin-url {admin_url!r}: want postgresql://SUPERUSER@HOST/postgres")
    if not name.isidentifier() or name.lower() != name:
        raise StoreError(f"--name {name!r}: want lower-case letters, digits and _")
    password = secrets.token_urlsafe(24)
    try:
        conn = psycopg2.connect(admin_url)
    except psycopg2.Error as e:
        raise StoreError(f"cannot connect to {_redacted(admin_url)}: {_line(e)}") from None
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,))
            role = cur.fetchone()
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if role or cur.fetchone():
                raise StoreError(
                    f"{name} exists already on {parsed.hostname}: its store URL is"
                    f" {store_url(admin_url, name)} (`llmgw store migrate` brings it up to"
                    " date); or pass another --name"
                )
            cur.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD %s").format(sql.Identifier(name)),
                        (password,))  # fmt: skip
            cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(name), sql.Identifier(name)))  # fmt: skip
    except psycopg2.Error as e:
        raise StoreError(f"cannot create {name} on {parsed.hostname}: {_line(e)}") from None
    finally:
        conn.close()
    url = store_url(admin_url, name)
    host, port = parsed.hostname or "localhost", parsed.port or 5432
    _add_pgpass(pgpass, f"{host}:{port}:{name}:{name}:{password}")
    db = open_store(url.replace(f"{name}@", f"{name}:{quote(password, safe='')}@", 1))
    try:
        migrate(db)
    finally:
        db.close()
    return url


def store_url(admin_url: str, name: str) -> str:
    p = urlparse(admin_url)
    port = f":{p.port}" if p.port else ""
    return f"postgresql://{name}@{p.hostname}{port}/{name}"


def _add_pgpass(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(line + "\n")
    os.chmod(path, 0o600)  # libpq ignores a .pgpass others may read


def _redacted(url: str) -> str:
    p = urlparse(url)
    return url.replace(f":{p.password}@", ":***@") if p.password else url


def _line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
