"""The store: peewee models on SQLite (one machine) or PostgreSQL (a fleet).

`open_store(url)` binds every model to the database at `url` and returns it;
`migrate(db)` brings its schema up to date. Tools open the store once at start.
"""

import os
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import peewee

from llmgw import dirs
from llmgw.errors import StoreError
from llmgw.store import timeouts
from llmgw.store.migrations import migrate, pending  # noqa: F401  (re-exported)
from llmgw.store.models import (  # noqa: F401  (re-exported)
    ALL_MODELS,
    ApiKey,
    AuditEntry,
    BusPeer,
    ClusterSecret,
    DrainedNode,
    JoinToken,
    Lease,
    MeasuredCapacity,
    MirroredWeights,
    ModelScale,
    NodeAccess,
    Operator,
    ParkedModel,
    PublishedRelease,
    ReplicaIntent,
    RuntimeModel,
    SchedulerSeen,
    StoredResponse,
    Usage,
    db_proxy,
)


def database_for(
    url: str, timeout_s: float = timeouts.DEFAULT_S, bounded: bool = False
) -> peewee.Database:
    """A peewee database for `sqlite:///abs/path`, `sqlite:rel/path` or `postgresql://…`.

    PostgreSQL: connecting, and finding a peer gone, take about `timeout_s` at most;
    `bounded` (the daemons) also bounds every round trip and statement by it
    (timeouts.py says why and how)."""
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        path = unquote(parsed.path) if parsed.netloc == "" else ""
        if not path:
            raise StoreError(f"store URL {url!r}: want sqlite:///absolute/path.db")
        # WAL lets the router's usage writer and the CLI write without blocking readers;
        # the busy timeout rides out the short write locks they still take.
        return peewee.SqliteDatabase(
            path, pragmas={"journal_mode": "wal", "busy_timeout": 5000, "foreign_keys": 1}
        )
    if parsed.scheme in ("postgresql", "postgres"):
        if not parsed.path.strip("/"):
            raise StoreError(f"store URL {url!r}: name the database, postgresql://host/NAME")
        if not timeout_s > 0:
            raise StoreError(f"store.timeout_s ({timeout_s:g}) must be above 0")
        return peewee.PostgresqlDatabase(
            unquote(parsed.path.lstrip("/")),
            host=parsed.hostname,
            port=parsed.port,
            user=unquote(parsed.username) if parsed.username else None,
            password=unquote(parsed.password) if parsed.password else None,
            # Which tool and process holds a connection, in pg_stat_activity.
            application_name=f"{os.path.basename(sys.argv[0])[:40]}:{os.getpid()}",
            **timeouts.libpq_params(timeout_s),
            **(
                {
                    "options": timeouts.server_options(timeout_s),
                    "connection_factory": timeouts.connection_class(float(timeout_s)),
                }
                if bounded
                else {}
            ),
        )
    raise StoreError(f"store URL {url!r}: scheme must be sqlite or postgresql")


def open_store(
    url: str,
    create_dirs: bool = True,
    timeout_s: float = timeouts.DEFAULT_S,
    bounded: bool = False,
) -> peewee.Database:
    """Open the store at `url` and bind the models to it (no migration); `timeout_s` and
    `bounded` as for database_for."""
    db = database_for(url, timeout_s, bounded)
    if isinstance(db, peewee.SqliteDatabase) and create_dirs:
        # SQLite writes beside the file too (its -wal and -shm), even to read.
        dirs.writable(Path(db.database).absolute().parent, "the SQLite store")
    try:
        db.connect(reuse_if_open=True)
    except peewee.OperationalError as e:
        raise StoreError(
            f"cannot open store {redact(url)}: {str(e).strip().splitlines()[0]}"
        ) from None
    db_proxy.initialize(db)
    return db


def drop_connection(db: peewee.Database | None = None) -> None:
    """Forget this thread's connection after an error, so its next query opens a fresh
    one: a PostgreSQL server that restarted, or terminated our backend, otherwise leaves
    a dead connection that fails every query from then on."""
    db = db or db_proxy.obj
    if db is None:
        return
    try:
        db.close()
    except Exception:
        db._state.reset()  # mid-transaction on a dead connection: nothing left to close


def redact(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    parsed = urlparse(url)
    if parsed.password:
        netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
        return parsed._replace(netloc=netloc).geturl()
    return url
