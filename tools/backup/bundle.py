"""What is inside an archive, and writing and reading one safely.

An archive is a tar.gz holding:

    MANIFEST.json      llmgw version, host, time, store kind, every file with its sha256
    store/llmgw.db     a SQLite snapshot (or store/llmgw.pgdump, a pg_dump custom dump)
    config/...         the configuration directory, pki/ and secrets/ included

It is written as NAME.part beside its final name, fsynced, then renamed, so a run that
is interrupted never leaves something under a name that looks like a good archive.
Reading trusts nothing: only regular files and directories under store/ and config/
are accepted, and every file must match the manifest, size and sha256.
"""

import gzip
import hashlib
import io
import json
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from llmgw.files import sha256_of
from llmgw_backup.errors import ArchiveError, BackupError

FORMAT = 1
MANIFEST = "MANIFEST.json"
STORE_FILES = {"sqlite": "store/llmgw.db", "postgresql": "store/llmgw.pgdump"}
CHUNK = 1 << 20


@dataclass
class Member:
    """One entry to write: a directory, bytes already read, or a file to stream."""

    name: str
    mode: int
    mtime: float
    is_dir: bool = False
    data: bytes | None = None  # config files are read once, so hash and content agree
    source: Path | None = None  # the store dump, which only this run writes
    uid: int = 0
    gid: int = 0


@dataclass
class Entry:
    """One entry read back from an archive."""

    name: str
    mode: int
    is_dir: bool
    uid: int
    gid: int


@dataclass
class Contents:
    """An archive extracted and checked: where it lies, and what it holds."""

    root: Path
    manifest: dict
    entries: list[Entry] = field(default_factory=list)

    @property
    def store_kind(self) -> str:
        return self.manifest["store"]["kind"]

    @property
    def store_file(self) -> Path:
        return self.root / self.manifest["store"]["file"]


def file_record(m: Member) -> dict:
    if m.data is not None:
        return {"path": m.name, "bytes": len(m.data), "sha256": hashlib.sha256(m.data).hexdigest()}
    return {"path": m.name, "bytes": m.source.stat().st_size, "sha256": sha256_of(m.source)}


class _Counting(io.RawIOBase):
    """A write-only file that hashes and counts what passes through it."""

    def __init__(self, raw):
        self.raw = raw
        self.size = 0
        self.hash = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.raw.write(b)
        self.hash.update(b)
        self.size += len(b)
        return len(b)


def write(final: Path, manifest: dict, members: list[Member]) -> tuple[int, str]:
    """Write the archive as FINAL.part, fsync, rename to FINAL. -> (bytes, sha256).

    On any failure the .part file is removed and FINAL does not exist.
    """
    part = final.with_name(final.name + ".part")
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise BackupError(f"{part} exists: is another backup running?") from None
    renamed = False
    try:
        os.fchmod(fd, 0o600)  # the archive holds secrets: whatever the umask
        with os.fdopen(fd, "wb") as raw:
            out = _Counting(raw)
            with tarfile.open(fileobj=out, mode="w:gz") as tar:
                text = json.dumps(manifest, indent=2, sort_keys=True).encode()
                _add(tar, Member(MANIFEST, 0o600, manifest["created_at"], data=text))
                for m in members:
                    _add(tar, m)
            raw.flush()
            os.fsync(raw.fileno())
        if final.exists():
            raise BackupError(f"{final} already exists: another backup ran this second")
        os.rename(part, final)
        renamed = True
        _fsync_dir(final.parent)
    finally:
        if not renamed:
            part.unlink(missing_ok=True)
    return out.size, out.hash.hexdigest()


def _add(tar: tarfile.TarFile, m: Member) -> None:
    info = tarfile.TarInfo(m.name)
    info.mode = m.mode & 0o7777
    info.mtime = int(m.mtime)
    info.uid, info.gid = m.uid, m.gid
    if m.is_dir:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif m.data is not None:
        info.size = len(m.data)
        tar.addfile(info, io.BytesIO(m.data))
    else:
        info.size = m.source.stat().st_size
        with open(m.source, "rb") as f:
            tar.addfile(info, f)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safe_name(archive: Path, name: str) -> str:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ArchiveError(f"{archive}: unsafe path {name!r} inside")
    if str(p) != MANIFEST and p.parts[0] not in ("store", "config"):
        raise ArchiveError(f"{archive}: unexpected entry {name!r}")
    return str(p)


def extract(archive: Path, into: Path) -> Contents:
    """Extract ARCHIVE into INTO and check it against its manifest; a bad archive raises."""
    contents = Contents(into, {})
    seen: dict[str, tuple[int, str]] = {}
    manifest = None
    try:
        f = open(archive, "rb")
    except OSError as e:
        raise ArchiveError(f"{archive}: {e.strerror.lower()}") from None
    try:
        with f, tarfile.open(fileobj=f, mode="r:gz") as tar:
            for info in tar:
                name = _safe_name(archive, info.name)
                if name == MANIFEST and info.isfile():
                    manifest = _parse_manifest(archive, tar.extractfile(info).read())
                elif info.isdir():
                    (into / name).mkdir(parents=True, exist_ok=True)
                    os.chmod(into / name, (info.mode & 0o777) | 0o700)
                    contents.entries.append(
                        Entry(name, info.mode & 0o777, True, info.uid, info.gid)
                    )
                elif info.isfile():
                    seen[name] = _extract_file(tar, info, into / name)
                    contents.entries.append(
                        Entry(name, info.mode & 0o777, False, info.uid, info.gid)
                    )
                else:
                    raise ArchiveError(f"{archive}: {name} is not a regular file or directory")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ArchiveError(f"{archive}: truncated or not an llmgw archive ({e})") from None
    if manifest is None:
        raise ArchiveError(f"{archive}: no {MANIFEST} inside: not an llmgw archive")
    listed = {f["path"]: (f["bytes"], f["sha256"]) for f in manifest["files"]}
    for name, want in listed.items():
        got = seen.get(name)
        if got is None:
            raise ArchiveError(f"{archive}: {name} is in the manifest but not in the archive")
        if got != want:
            raise ArchiveError(f"{archive}: {name} does not match its sha256 in the manifest")
    extra = sorted(set(seen) - set(listed))
    if extra:
        raise ArchiveError(f"{archive}: {extra[0]} is not in the manifest")
    if manifest["store"]["file"] not in seen:
        raise ArchiveError(f"{archive}: the store dump {manifest['store']['file']} is missing")
    contents.manifest = manifest
    return contents


def _entry(name: str, info: tarfile.TarInfo) -> Entry:
    return Entry(name, info.mode & 0o777, info.isdir(), info.uid, info.gid)


def _extract_file(tar: tarfile.TarFile, info: tarfile.TarInfo, target: Path) -> tuple[int, str]:
    target.parent.mkdir(parents=True, exist_ok=True)
    h, size = hashlib.sha256(), 0
    with tar.extractfile(info) as src, open(target, "wb") as dst:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
            dst.write(chunk)
    os.chmod(target, info.mode & 0o777)
    return size, h.hexdigest()


def _parse_manifest(archive: Path, raw: bytes) -> dict:
    try:
        manifest = json.loads(raw)
        fmt = manifest["format"]
        kind = manifest["store"]["kind"]
        store_file = manifest["store"]["file"]
        for f in manifest["files"]:
            if not isinstance(f["path"], str) or not isinstance(f["sha256"], str):
                raise TypeError(f"bad entry {f!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise ArchiveError(f"{archive}: {MANIFEST} is malformed ({e})") from None
    if fmt != FORMAT:
        raise ArchiveError(f"{archive}: archive format {fmt} is not {FORMAT}: use a newer llmgw")
    if STORE_FILES.get(kind) != store_file:
        raise ArchiveError(f"{archive}: unknown store {kind!r} in {MANIFEST}")
    return manifest
