"""The store, whichever kind it is: dump, inspect, check what is there, restore."""

from pathlib import Path
from urllib.parse import urlparse

from llmgw.store import redact
from llmgw_backup import postgres, sqlite
from llmgw_backup.errors import BackupError


def kind_of(url: str) -> str:
    scheme = urlparse(url).scheme
    if scheme == "sqlite":
        return "sqlite"
    if scheme in ("postgresql", "postgres"):
        return "postgresql"
    raise BackupError(f"store URL {redact(url)!r}: scheme must be sqlite or postgresql")


def dump(url: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    (sqlite if kind_of(url) == "sqlite" else postgres).dump(url, out)


def inspect(kind: str, file: Path) -> dict:
    return (sqlite if kind == "sqlite" else postgres).inspect(file)


def occupants(url: str) -> list[str]:
    return (sqlite if kind_of(url) == "sqlite" else postgres).occupants(url)


def restore(url: str, file: Path, force: bool) -> None:
    if kind_of(url) == "sqlite":
        sqlite.restore(url, file)
    else:
        postgres.restore(url, file, force)
