"""`llmgw-backup restore`: put an archive's store, and its configuration where asked, back.

Everything is checked before anything is written: the archive (as `verify` does),
the store kinds, the store's emptiness, and which configuration files would change.
A store with tables in it, or a configuration file that differs from the archive's,
is only replaced with --force. Files in the configuration directory that the archive
does not hold are left alone.

The configuration is restored only into the directory named by `--config-to`. It used
to go into the configured directory every time, so the documented "restore into a
scratch database" check also wrote into the live /etc/llmgw, and its refusal ("…
differ from the archive's copy: pass --force") invited overwriting the live config.
"""

import os
import tempfile
from pathlib import Path

from llmgw.config import Config
from llmgw.store import redact
from llmgw_backup import bundle, stores, verify
from llmgw_backup.errors import BackupError, RestoreRefused


def restore(cfg: Config, archive: Path, force: bool, config_to: Path | None = None) -> dict:
    """Restore the store; and the configuration files into `config_to`, if given."""
    url = cfg.store_url()
    config_dir = config_to
    with tempfile.TemporaryDirectory(prefix="llmgw-restore-") as tmp:
        contents = bundle.extract(archive, Path(tmp))
        facts = verify.check(contents, archive)
        kind = stores.kind_of(url)
        if kind != contents.store_kind:
            raise BackupError(
                f"{archive} holds a {contents.store_kind} store but the configured store"
                f" is {redact(url)}: restore into a {contents.store_kind} store"
            )
        there = stores.occupants(url)
        if there and not force:
            shown = ", ".join(there[:4]) + (", …" if len(there) > 4 else "")
            raise RestoreRefused(
                f"store {redact(url)} is not empty (tables: {shown}):"
                " stop llmgw and pass --force to replace it"
            )
        files = [e for e in contents.entries if e.name.startswith("config/") and not e.is_dir]
        if config_dir is None:
            changed = []
        else:
            changed = [e for e in files if _differs(Path(tmp) / e.name, _target(config_dir, e))]
        if changed and not force:
            first = _target(config_dir, changed[0])
            more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
            raise RestoreRefused(
                f"{first}{more} differ from the archive's copy: pass --force to replace them"
            )
        stores.restore(url, contents.store_file, force)
        written = (
            [] if config_dir is None else _restore_config(Path(tmp), contents.entries, config_dir)
        )
    return {
        **verify.summary(archive, contents, facts),
        "store_url": redact(url),
        "config_dir": None if config_dir is None else str(config_dir),
        "config_written": written,
        "config_unchanged": 0 if config_dir is None else len(files) - len(written),
        "config_files": len(files),
    }


def _target(config_dir: Path, entry: bundle.Entry) -> Path:
    return config_dir / entry.name.removeprefix("config").lstrip("/")


def _differs(ours: Path, theirs: Path) -> bool:
    if not theirs.exists() and not theirs.is_symlink():
        return False
    if not theirs.is_file():
        return True
    return theirs.stat().st_size != ours.stat().st_size or theirs.read_bytes() != ours.read_bytes()


def _restore_config(root: Path, entries: list[bundle.Entry], config_dir: Path) -> list[str]:
    """Write the archive's configuration files that are missing or differ; -> their paths."""
    as_root = os.geteuid() == 0
    written = []
    for e in entries:
        if not e.name.startswith("config"):
            continue
        target = _target(config_dir, e)
        if e.is_dir:
            if not target.is_dir():
                target.mkdir(parents=True, mode=0o700)
                os.chmod(target, e.mode)
                if as_root:
                    os.chown(target, e.uid, e.gid)
            continue
        source = root / e.name
        if target.is_file() and not _differs(source, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}.restore-part")
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(source.read_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.chmod(part, e.mode)
            if as_root:  # files go back to their owners, as numbers: the archive's host
                os.chown(part, e.uid, e.gid)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        written.append(str(target))
    return written
