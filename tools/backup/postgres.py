"""The PostgreSQL store: pg_dump and pg_restore, and reading a dump without a server.

The connection goes to pg_dump and pg_restore in libpq's environment variables
(PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE), never in their arguments: any user
on the machine can read a process's argv in /proc, and a URL there carries the password.
What the URL does not say is left to the environment, as psycopg2 does for the tools.
"""

import os
import re
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

import peewee

from llmgw.store import database_for, redact
from llmgw_backup.errors import ArchiveError, DumpError


def conn_env(url: str) -> dict[str, str]:
    """libpq environment variables for `url`: the only place the password goes."""
    p = urlparse(url)
    env = {"PGDATABASE": unquote(p.path.lstrip("/"))}
    host = p.netloc.rpartition("@")[2]
    host = host.rsplit(":", 1)[0] if p.port else host
    if host:
        env["PGHOST"] = unquote(host.strip("[]"))
    if p.port:
        env["PGPORT"] = str(p.port)
    if p.username:
        env["PGUSER"] = unquote(p.username)
    if p.password:
        env["PGPASSWORD"] = unquote(p.password)
    return env


def dump_argv(out: Path) -> list[str]:
    # --no-password: a timer job must fail, not wait at a prompt.
    return ["pg_dump", "--format=custom", "--no-password", f"--file={out}"]


def restore_argvs(
    file: Path, sql: Path, database: str, drop: list[str]
) -> tuple[list[str], list[str]]:
    """pg_restore turning the dump into the SQL file `sql` (no connection), psql loading it.

    psql runs the DROP of the tables being replaced and the whole script in one
    transaction: a restore that fails half way leaves the database as it was.
    --no-owner/--no-acl: the restoring user owns what it restores, as on a first install.
    The database name is no secret; the rest of the connection is in the environment.
    """
    script = ["pg_restore", "--no-owner", "--no-acl", f"--file={sql}", str(file)]
    load = ["psql", "--no-psqlrc", "--quiet", "--no-password", "--single-transaction"]
    load += ["--set=ON_ERROR_STOP=1", f"--dbname={database}"]
    if drop:
        load.append("--command=DROP TABLE IF EXISTS " + ", ".join(map(_ident, drop)) + " CASCADE")
    return script, [*load, f"--file={sql}"]


def _ident(name: str) -> str:
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split(".", 1))


def _run(argv: list[str], env: dict[str, str], what: str) -> str:
    try:
        result = subprocess.run(
            argv, env={**os.environ, **env}, capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise DumpError(f"{argv[0]} is not installed (apt-get install postgresql-client)") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = " ".join(lines[0].split()) if lines else f"exit status {result.returncode}"
        reason = re.sub(r"^(pg_dump|pg_restore|psql): (error: )?", "", reason)
        raise DumpError(f"{what} failed: {reason}")
    return result.stdout


def dump(url: str, out: Path) -> None:
    _run(dump_argv(out), conn_env(url), f"pg_dump of {redact(url)}")


def inspect(file: Path) -> dict:
    """What a dump holds, read by pg_restore alone: no server, no scratch database.

    `pg_restore --list` reads the whole table of contents; `--data-only --table=… -f -`
    turns two tables' data back into the COPY text a restore would load, which shows
    that the engine-key secret's row is really there.
    """
    try:
        _run(["pg_restore", "--list", str(file)], {}, "pg_restore --list")
        sql = _run(
            ["pg_restore", "--data-only", "--table=cluster_secrets", "--table=api_keys"]
            + ["--file=-", str(file)],
            {},
            "pg_restore of the dump's data",
        )
    except DumpError as e:
        raise ArchiveError(f"the PostgreSQL dump in the archive is unreadable: {e}") from None
    rows = copy_rows(sql)
    secret = [r for r in rows.get("cluster_secrets", []) if r[:1] == ["engine_keys"]]
    return {"api_keys": len(rows.get("api_keys", [])), "engine_secret": bool(secret)}


_COPY = re.compile(r"^COPY (?:[\w\"]+\.)?\"?(\w+)\"? \(.*\) FROM stdin;$")


def copy_rows(sql: str) -> dict[str, list[list[str]]]:
    """The rows of every COPY block in a SQL script, by table, as tab-separated fields."""
    rows: dict[str, list[list[str]]] = {}
    table = None
    for line in sql.splitlines():
        if table is None:
            m = _COPY.match(line)
            if m:
                table = m.group(1)
                rows.setdefault(table, [])
        elif line == "\\.":
            table = None
        else:
            rows[table].append(line.split("\t"))
    return rows


def _connect(url: str) -> peewee.Database:
    db = database_for(url)
    try:
        db.connect()
    except peewee.OperationalError as e:
        reason = str(e).strip().splitlines()[0]
        raise DumpError(f"cannot connect to {redact(url)}: {reason}") from None
    return db


def occupants(url: str) -> list[str]:
    """The tables in the database at `url`, outside PostgreSQL's own schemas."""
    db = _connect(url)
    try:
        cursor = db.execute_sql(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_schema NOT IN ('pg_catalog', 'information_schema')"
            " ORDER BY table_schema, table_name"
        )
        return [name if schema == "public" else f"{schema}.{name}" for schema, name in cursor]
    finally:
        db.close()


def restore(url: str, file: Path, force: bool) -> None:
    """Load the dump into the database at `url`; with `force`, replace llmgw's tables."""
    env = conn_env(url)
    # Only the public schema is llmgw's: with --force its tables go, even those the dump
    # lacks (a later migration's), so the store is the archive's and nothing else.
    drop = [t for t in occupants(url) if "." not in t] if force else []
    with tempfile.TemporaryDirectory(prefix="llmgw-restore-") as tmp:
        # The whole script is written before psql starts: fed from a pipe, a pg_restore
        # that died half way would look like a short script, and psql would commit it.
        sql = Path(tmp) / "store.sql"
        script, load = restore_argvs(file, sql, env["PGDATABASE"], drop)
        _run(script, {}, "pg_restore of the dump")
        _run(load, env, f"restore into {redact(url)}")
