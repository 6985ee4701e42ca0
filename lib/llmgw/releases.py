"""Releases: llmgw wheels kept in the control plane's release directory, and the notes
`make release` writes from CHANGELOG.md.

A release is one wheel, named and versioned as PEP 427 and PEP 440 say; the version
comes from one place, `llmgw.__version__`. A small fix published before the next
version is an rc of the next patch: 0.2.1rc1 sorts after 0.2.0 and before 0.2.1, so
"the newest release" is simply the highest `packaging.version.Version`. Onboarding and
upgrades install from this directory, never from an operator's checkout.
"""

import hashlib
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from llmgw.errors import Conflict, Invalid, NotFound

PROJECT = "llmgw"
# A wheel is a few MB; anything near this is not one of ours.
MAX_WHEEL_BYTES = 256 * 1024 * 1024
_CHUNK = 1024 * 1024


class ChangelogError(Invalid):
    """CHANGELOG.md has no `## Unreleased` section with anything in it."""


@dataclass(frozen=True)
class Release:
    version: Version
    filename: str
    size: int
    sha256: str
    published: float

    def json(self) -> dict:
        """The one JSON shape of a release."""
        return {
            "version": str(self.version),
            "filename": self.filename,
            "size": self.size,
            "sha256": self.sha256,
            "published": self.published,
            "prerelease": self.version.is_prerelease,
        }


def unreleased(changelog: str) -> str:
    """The body of CHANGELOG.md's `## Unreleased` section, up to the next `## `."""
    m = re.search(r"^## Unreleased[ \t]*\n(.*?)(?=^## |\Z)", changelog, re.M | re.S)
    body = m.group(1).strip() if m else ""
    if not body:
        raise ChangelogError("CHANGELOG.md has no '## Unreleased' section with entries")
    return body


def notes(changelog: str, version: str) -> str:
    """Release notes for `version`: the Unreleased section under the version's title."""
    return f"# llmgw {Version(version)}\n\n{unreleased(changelog)}\n"


def wheel_version(filename: str) -> Version:
    """The version an llmgw wheel's file name carries; anything else is Invalid."""
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        raise Invalid(f"{filename}: not a wheel file name (want llmgw-VERSION-*.whl)") from None
    if name != PROJECT:
        raise Invalid(f"{filename}: a wheel of {name}, not of {PROJECT}")
    return version


def sorted_versions(versions) -> list[str]:
    """Oldest first, by PEP 440 (0.2.0 < 0.2.1rc1 < 0.2.1)."""
    return [str(v) for v in sorted(Version(str(v)) for v in versions)]


def _check_wheel(path: Path, version: Version) -> None:
    """The file is a zip whose METADATA names llmgw at the version its file name says."""
    try:
        with zipfile.ZipFile(path) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode("utf-8", "replace") if meta else ""
    except (zipfile.BadZipFile, OSError) as e:
        raise Invalid(f"{path.name}: not a wheel ({e})") from None
    fields = dict(
        line.split(": ", 1) for line in text.splitlines() if ": " in line and line[0] != " "
    )
    if fields.get("Name", "").lower() != PROJECT or Version(fields.get("Version", "0")) != version:
        raise Invalid(
            f"{path.name}: its METADATA says {fields.get('Name')} {fields.get('Version')},"
            f" not {PROJECT} {version}"
        )


class ReleaseDir:
    """The control plane's release directory: one wheel per version, each with its
    SHA-256 beside it (`NAME.sha256`), written by rename so a reader never sees half."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def publish(self, filename: str, stream, length: int, now: float) -> tuple[Release, bool]:
        """Write `length` bytes from `stream` as `filename`. (release, True) when new;
        the same bytes again are (release, False); other bytes for a published version
        are a Conflict (a version never changes once nodes may have installed it)."""
        version = wheel_version(filename)
        if length <= 0 or length > MAX_WHEEL_BYTES:
            raise Invalid(f"{filename}: {length} bytes is not a wheel's size")
        self.path.mkdir(parents=True, exist_ok=True)
        part = self.path / f".{filename}.part"
        digest = hashlib.sha256()
        left = length
        with open(part, "wb") as f:
            while left:
                block = stream.read(min(_CHUNK, left))
                if not block:
                    break
                digest.update(block)
                f.write(block)
                left -= len(block)
        try:
            if left:
                raise Invalid(f"{filename}: the upload ended {left} bytes short")
            _check_wheel(part, version)
            sha = digest.hexdigest()
            old = self.find(str(version))
            if old is not None:
                if old.sha256 == sha and old.filename == filename:
                    return old, False
                raise Conflict(
                    f"release {version} is already published as {old.filename} (sha256"
                    f" {old.sha256[:12]}…) and differs from this one ({sha[:12]}…):"
                    " a published version never changes; publish the next one"
                    f" (e.g. {next_rc(str(version))})",
                    code="release_exists",
                )
            (self.path / f"{filename}.sha256").write_text(f"{sha}  {filename}\n")
            os.utime(part, (now, now))
            part.replace(self.path / filename)
        finally:
            part.unlink(missing_ok=True)
        return self.find(str(version)), True

    def releases(self) -> list[Release]:
        """Every published release, oldest first by version."""
        out = []
        if not self.path.is_dir():
            return out
        for wheel in self.path.glob("*.whl"):
            try:
                version = wheel_version(wheel.name)
                sha = (self.path / f"{wheel.name}.sha256").read_text().split()[0]
                st = wheel.stat()
            except (Invalid, OSError, IndexError):
                continue  # not one of ours, or half-written by hand
            out.append(Release(version, wheel.name, st.st_size, sha, st.st_mtime))
        return sorted(out, key=lambda r: r.version)

    def find(self, version: str) -> Release | None:
        want = Version(version)
        return next((r for r in self.releases() if r.version == want), None)

    def newest(self, pre: bool = True) -> Release:
        """The highest version (rcs included unless pre=False); NotFound if none."""
        found = [r for r in self.releases() if pre or not r.version.is_prerelease]
        if not found:
            raise NotFound(
                f"no release in {self.path}: build one with `make release` and"
                " `llmgw release publish dist/llmgw-VERSION-py3-none-any.whl`",
                code="no_release",
            )
        return found[-1]

    def file(self, filename: str) -> Path:
        """A published wheel's path; NotFound for anything else."""
        wheel_version(filename)
        path = self.path / filename
        if "/" in filename or not path.is_file():
            raise NotFound(f"no release file {filename}", code="release_not_found")
        return path


def next_rc(version: str) -> str:
    """The version of a small fix published after `version`: an rc of the next patch
    (0.2.0 -> 0.2.1rc1), or the next rc (0.2.1rc1 -> 0.2.1rc2)."""
    v = Version(version)
    major, minor, micro = (list(v.release) + [0, 0, 0])[:3]
    if v.pre and v.pre[0] == "rc":
        return f"{major}.{minor}.{micro}rc{v.pre[1] + 1}"
    return f"{major}.{minor}.{micro + 1}rc1"
