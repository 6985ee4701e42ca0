"""`llmgw-backup verify`: is this archive whole, and would its store bring the cluster back?

Sound means: the archive reads to the end; every file matches the size and sha256 in
its manifest and nothing unlisted is inside; the store opens (SQLite: `PRAGMA
quick_check`; a PostgreSQL dump: `pg_restore` reads its whole table of contents and
turns its data back into SQL, no server needed); and it holds the engine-key secret,
without which every running engine's key would change after a restore.
"""

import tempfile
from pathlib import Path

from llmgw_backup import bundle, stores
from llmgw_backup.errors import ArchiveError


def check(contents: bundle.Contents, archive: Path) -> dict:
    """Inspect an extracted archive's store; -> what it holds. Raises if it is unsound."""
    facts = stores.inspect(contents.store_kind, contents.store_file)
    if not facts["engine_secret"]:
        raise ArchiveError(
            f"{archive}: the store has no engine-key secret (cluster_secrets 'engine_keys'):"
            " a restore would change every engine's key"
        )
    return facts


def verify(archive: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmgw-verify-") as tmp:
        contents = bundle.extract(archive, Path(tmp))
        facts = check(contents, archive)
    return summary(archive, contents, facts)


def summary(archive: Path, contents: bundle.Contents, facts: dict) -> dict:
    m = contents.manifest
    return {
        "path": str(archive),
        "ok": True,
        "created_at": m["created_at"],
        "host": m["host"],
        "llmgw_version": m["llmgw_version"],
        "store": m["store"]["kind"],
        "api_keys": facts["api_keys"],
        "engine_secret": facts["engine_secret"],
        "config_files": sum(1 for f in m["files"] if f["path"].startswith("config/")),
    }
