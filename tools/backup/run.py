"""`llmgw-backup run`: one archive of the store and the configuration directory."""

import os
import socket
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from llmgw import __version__, log
from llmgw import backups as archive
from llmgw.config import Config
from llmgw.dirs import identity, writable
from llmgw.store import redact
from llmgw_backup import bundle, stores
from llmgw_backup.errors import BackupError

_log = log.get("llmgw.backup")


def backup(cfg: Config, directory: Path, keep: int, now: datetime | None = None) -> dict:
    """Write one archive into `directory`, then prune to the newest `keep`. -> its JSON."""
    started = time.monotonic()
    now = now or datetime.now(UTC)
    url = cfg.store_url()
    kind = stores.kind_of(url)
    ensure_dir(directory)
    final = directory / archive.name_for(now)
    if final.exists():
        raise BackupError(f"{final} already exists: another backup ran this second")
    # The dump is staged beside the archives, not in /tmp: a store can outgrow a tmpfs.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".llmgw-staging-") as staging:
        dump = Path(staging) / bundle.STORE_FILES[kind]
        stores.dump(url, dump)
        members = [bundle.Member(bundle.STORE_FILES[kind], 0o600, now.timestamp(), source=dump)]
        skip = {directory.resolve()}
        if kind == "sqlite":  # a store kept in the config dir is in the archive already
            live = Path(stores.sqlite.path_of(url)).resolve()
            skip |= {live.with_name(live.name + s) for s in ("", "-wal", "-shm", "-journal")}
        members += config_members(Path(cfg.paths.config_dir), skip)
        manifest = {
            "format": bundle.FORMAT,
            "llmgw_version": __version__,
            "host": socket.gethostname(),
            "created": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "created_at": now.timestamp(),
            "store": {"kind": kind, "file": bundle.STORE_FILES[kind], "url": redact(url)},
            "config_dir": str(Path(cfg.paths.config_dir).absolute()),
            "files": [bundle.file_record(m) for m in members if not m.is_dir],
        }
        size, digest = bundle.write(final, manifest, members)
    _log.info("archive_written", path=final, bytes=size, store=kind)
    pruned = archive.prune(directory, keep, protect=final)
    for path in pruned:
        _log.info("archive_pruned", path=path, keep=keep)
    return {
        **archive.Archive(final, now.timestamp(), size, final.stat().st_mtime).json(),
        "sha256": digest,
        "duration_s": round(time.monotonic() - started, 3),
        "store": kind,
        "pruned": [str(p) for p in pruned],
    }


def ensure_dir(directory: Path) -> None:
    """Make the backup directory, listable (0755): the archives in it are 0600 themselves."""
    made = not directory.is_dir()
    writable(directory, "archives")
    if made:
        try:
            os.chmod(directory, 0o755)
        except OSError:  # another run, as another user, made it a moment ago
            pass


def config_members(config_dir: Path, skip: set[Path]) -> list[bundle.Member]:
    """The configuration directory as archive members under config/, read once each.

    A symlink to a file is stored as the file it points to (certificates are often
    linked); other special files are left out with a warning. A file that cannot be
    read fails the backup: an archive without the CA key would restore a broken cluster.
    """
    if not config_dir.is_dir():
        raise BackupError(f"configuration directory {config_dir} does not exist")
    members = [_dir_member("config", config_dir)]
    for root, dirs, files in os.walk(config_dir):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if (here / d).resolve() not in skip)
        for d in dirs:
            if (here / d).is_symlink():
                _log.warning("backup_skipped", path=here / d, reason="symlinked directory")
                continue
            members.append(_dir_member(_inside(config_dir, here / d), here / d))
        for name in sorted(files):
            path = here / name
            if path.resolve() in skip:
                continue
            if not path.is_file():
                _log.warning("backup_skipped", path=path, reason="not a regular file")
                continue
            try:
                data = path.read_bytes()
                st = path.stat()
            except OSError as e:
                fix = ""
                if isinstance(e, PermissionError):
                    user, group = identity()
                    fix = f" (it runs as {user}: `chgrp {group} {path} && chmod g+r {path}`)"
                raise BackupError(f"cannot read {path}: {e.strerror}{fix}") from None
            members.append(
                bundle.Member(
                    _inside(config_dir, path),
                    st.st_mode,
                    st.st_mtime,
                    data=data,
                    uid=st.st_uid,
                    gid=st.st_gid,
                )
            )
    return members


def _inside(config_dir: Path, path: Path) -> str:
    return "config/" + path.relative_to(config_dir).as_posix()


def _dir_member(name: str, path: Path) -> bundle.Member:
    st = path.stat()
    return bundle.Member(name, st.st_mode, st.st_mtime, is_dir=True, uid=st.st_uid, gid=st.st_gid)
