"""The SQLite store: a consistent snapshot with VACUUM INTO, its inspection and restore.

The live file is never copied: the router and the scheduler write it in WAL mode, and
a copy taken between a commit to the -wal file and its checkpoint misses that commit
or is torn. VACUUM INTO reads one transaction's view and writes it as a new file.
"""

import os
import shutil
import sqlite3
from pathlib import Path

from llmgw.store import database_for
from llmgw_backup.errors import ArchiveError, DumpError


def path_of(url: str) -> Path:
    return Path(database_for(url).database)


def dump(url: str, out: Path) -> None:
    """Write a snapshot of the store at `url` to `out` (which must not exist)."""
    path = path_of(url)
    if not path.is_file():
        raise DumpError(f"store {url}: {path} does not exist")
    try:
        # mode=rw, not ro: a read-only connection to a WAL database fails when it cannot
        # create the -shm index; rw never creates the database itself, and VACUUM INTO
        # only reads it.
        conn = sqlite3.connect(f"{path.as_uri()}?mode=rw", uri=True, timeout=30)
        try:
            conn.execute("VACUUM INTO ?", (str(out),))
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise DumpError(f"cannot snapshot {path}: {e}") from None


def _tables(conn: sqlite3.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        " ORDER BY name"
    )
    return [r[0] for r in rows]


def inspect(file: Path) -> dict:
    """What a snapshot holds: {"api_keys": n, "engine_secret": bool}; a damaged one raises."""
    try:
        conn = sqlite3.connect(f"{file.as_uri()}?mode=ro", uri=True)
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise ArchiveError(f"the SQLite store in the archive is damaged: {check}")
            tables = set(_tables(conn))
            keys = secret = 0
            if "api_keys" in tables:
                keys = conn.execute("SELECT count(*) FROM api_keys").fetchone()[0]
            if "cluster_secrets" in tables:
                secret = conn.execute(
                    "SELECT count(*) FROM cluster_secrets WHERE name = 'engine_keys'"
                    " AND value != ''"
                ).fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise ArchiveError(f"the SQLite store in the archive cannot be read: {e}") from None
    return {"api_keys": keys, "engine_secret": secret > 0}


def occupants(url: str) -> list[str]:
    """The tables in the store at `url`; [] when there is no store there yet."""
    path = path_of(url)
    if not path.exists() or path.stat().st_size == 0:
        return []
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=30)
        try:
            return _tables(conn)
        finally:
            conn.close()
    except sqlite3.Error as e:
        raise DumpError(f"cannot read the store {path}: {e}") from None


def restore(url: str, file: Path) -> None:
    """Put the snapshot `file` in place of the store at `url`, atomically."""
    path = path_of(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".restore-part")
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o640
    try:
        shutil.copyfile(file, part)
        os.chmod(part, mode)
        if os.geteuid() == 0:  # a root restore leaves the store to whoever owns its directory
            st = path.parent.stat()
            os.chown(part, st.st_uid, st.st_gid)
        with open(part, "rb") as f:
            os.fsync(f.fileno())
        # The old store's WAL must go before the new file arrives: SQLite would replay it
        # onto a database it does not belong to.
        for suffix in ("-wal", "-shm", "-journal"):
            path.with_name(path.name + suffix).unlink(missing_ok=True)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
