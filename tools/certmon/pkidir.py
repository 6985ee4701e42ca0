"""The PKI directory: ca.key and ca.crt, and NAME.key and NAME.crt for every issued name.

Every file is written to a temporary name beside it, synced, then renamed into place, so
a reader (a service loading its certificate, a scrape) sees the old file or the new one,
never half of one. Keys are 0600 from the moment they exist.
"""

import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import config as configmod
from llmgw import dirs
from llmgw_certmon import certs
from llmgw_certmon.errors import CertmonError, ExistsError, NoCAError, ReadError

CA = "ca"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def pki_dir(cfg: configmod.Config) -> Path:
    """certmon.dir (relative to the config file's directory), else <config_dir>/pki."""
    if not cfg.certmon.dir:
        return Path(cfg.paths.config_dir) / "pki"
    base = Path(cfg.source).absolute().parent if cfg.source else Path.cwd()
    return base / cfg.certmon.dir


def check_name(name: str) -> str:
    if name == CA or not _NAME.match(name) or name.endswith((".key", ".crt")):
        raise CertmonError(
            f"bad name {name!r}: want letters, digits, '.', '_' or '-' (and not 'ca')"
        )
    return name


@dataclass(frozen=True)
class CertFile:
    """One certificate as read from the directory."""

    name: str
    path: Path
    cert: x509.Certificate

    @property
    def not_after(self) -> datetime:
        return self.cert.not_valid_after_utc

    @property
    def subject(self) -> str:
        return self.cert.subject.rfc4514_string()


def write_atomic(path: Path, data: bytes, mode: int, replace: bool = True) -> None:
    """Write `data` to `path` via a synced temp file; with replace=False, never clobber."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if path exists, even if it appeared a moment ago
            except FileExistsError:
                raise ExistsError(f"{path} already exists: not overwriting it") from None
            os.unlink(tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _spki(public_key) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


class PkiDir:
    def __init__(self, path: Path):
        self.path = path

    def key_path(self, name: str) -> Path:
        return self.path / f"{name}.key"

    def cert_path(self, name: str) -> Path:
        return self.path / f"{name}.crt"

    def ensure(self) -> None:
        dirs.writable(self.path, "certificates")

    def _write_pair(self, name: str, issued: certs.Issued, replace: bool = True) -> None:
        self.ensure()
        try:
            write_atomic(self.key_path(name), issued.key_pem, 0o600, replace=replace)
            write_atomic(self.cert_path(name), issued.cert_pem, 0o644, replace=replace)
        except OSError as e:
            raise dirs.cannot_write(self.path, e, f"{name}.key and {name}.crt") from None

    def has_ca(self) -> bool:
        return self.cert_path(CA).exists() or self.key_path(CA).exists()

    def load_ca(self) -> tuple[certs.Key, x509.Certificate]:
        if not self.cert_path(CA).exists():
            raise NoCAError(f"no CA in {self.path}: run `llmgw-certmon init-ca` first")
        cert = self.read_cert(CA)
        key = certs.load_key(self._read(self.key_path(CA)), str(self.key_path(CA)))
        if _spki(key.public_key()) != _spki(cert.public_key()):
            raise ReadError(f"{self.key_path(CA)} is not the key of {self.cert_path(CA)}")
        return key, cert

    def write_ca(self, issued: certs.Issued, replace: bool = False) -> None:
        """The key first: a ca.crt with no key beside it would be a CA nobody can use."""
        self._write_pair(CA, issued, replace=replace)

    def write(self, name: str, issued: certs.Issued) -> None:
        # Two renames cannot be one: a service that reloads between them sees a key that
        # does not match its certificate, fails to load, and must retry (not keep the old).
        self._write_pair(name, issued)

    def read_cert(self, name: str) -> x509.Certificate:
        path = self.cert_path(name)
        return certs.load_cert(self._read(path), str(path))

    def names(self) -> list[str]:
        """Every NAME with a NAME.crt, the CA first."""
        if not self.path.is_dir():
            return []
        found = sorted(p.stem for p in self.path.glob("*.crt") if not p.name.startswith("."))
        return sorted(found, key=lambda n: n != CA)

    def read_all(self) -> tuple[list[CertFile], dict[str, str]]:
        """Every certificate that parses, and for each that does not, why: (certs, errors)."""
        found, errors = [], {}
        for name in self.names():
            try:
                found.append(CertFile(name, self.cert_path(name), self.read_cert(name)))
            except ReadError as e:
                errors[name] = str(e)
        return found, errors

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ReadError(f"{path}: no such file") from None
        except OSError as e:
            raise ReadError(f"{path}: {e.strerror}") from None
