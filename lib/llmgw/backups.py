"""Archives in the backup directory: their names, listing, the newest one, pruning.

Pure file listing: nothing here opens an archive. Only names that match the exact
pattern below are ours; anything else in the directory — another run's `.part` file,
an operator's copy, a foreign file — is never listed and never deleted.
"""

import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

PATTERN = re.compile(r"^llmgw-(\d{8}T\d{6}Z)\.tar\.gz$")
STAMP = "%Y%m%dT%H%M%SZ"


@dataclass(frozen=True)
class Archive:
    path: Path
    created_at: float  # from the name: when the run began, UTC
    bytes: int
    mtime: float

    def json(self) -> dict:
        """The one JSON shape of an archive, used by every command that prints one."""
        return {
            "path": str(self.path),
            "name": self.path.name,
            "bytes": self.bytes,
            "created_at": self.created_at,
        }


def name_for(when: datetime) -> str:
    return f"llmgw-{when.astimezone(UTC).strftime(STAMP)}.tar.gz"


def created_at(name: str) -> float | None:
    """The time in an archive's name, or None if the name is not one of ours."""
    m = PATTERN.match(name)
    if m is None:
        return None
    return datetime.strptime(m.group(1), STAMP).replace(tzinfo=UTC).timestamp()


def archives(directory: Path) -> list[Archive]:
    """Our archives in `directory`, newest first (by the time in the name)."""
    found = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        when = created_at(entry.name)
        if when is None or not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        found.append(Archive(Path(entry.path), when, st.st_size, st.st_mtime))
    return sorted(found, key=lambda a: a.path.name, reverse=True)


def newest(directory: str | os.PathLike) -> tuple[Path, float] | None:
    """(path, mtime) of the newest archive in `directory`, or None: for the last-success metric."""
    found = archives(Path(directory))
    if not found:
        return None
    return found[0].path, found[0].mtime


def to_prune(found: list[Archive], keep: int, protect: Path | None = None) -> list[Archive]:
    """Which archives go so that the newest `keep` stay (0 keeps all); `protect` always stays.

    `protect` is the archive just written: if the clock stepped back, its name sorts
    older than the rest, and it must not be the one deleted.
    """
    if keep <= 0:
        return []
    others = [a for a in found if a.path != protect]
    slots = keep - (len(found) - len(others))
    return others[max(slots, 0) :]


def prune(directory: Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` archives; return the paths deleted."""
    gone = []
    for a in to_prune(archives(directory), keep, protect):
        try:
            a.path.unlink()
        except FileNotFoundError:  # another run pruned it first
            continue
        gone.append(a.path)
    return gone
