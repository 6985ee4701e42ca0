"""Releases: PEP 440 ordering, release notes from the changelog, the release directory,
and `make release`'s script building the version that lives in one place."""

import io
import subprocess
import sys
import zipfile
from importlib.metadata import version as installed_version

import pytest
from packaging.version import Version

import llmgw
from llmgw import releases
from llmgw.errors import Conflict, Invalid, NotFound
from tests.helpers import ROOT


def wheel_bytes(version: str, name: str = "llmgw", extra: bytes = b"") -> bytes:
    """A minimal wheel: what the release directory checks is its METADATA."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"llmgw-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")  # fmt: skip
        z.writestr("llmgw/__init__.py", b"# " + extra)
    return buf.getvalue()


def publish(d: releases.ReleaseDir, version: str, data: bytes | None = None, now=1000.0):
    data = wheel_bytes(version) if data is None else data
    return d.publish(f"llmgw-{version}-py3-none-any.whl", io.BytesIO(data), len(data), now)


def test_an_rc_of_the_next_patch_sorts_after_the_release_before_it_and_before_the_patch():
    assert Version("0.2.0") < Version("0.2.1rc1") < Version("0.2.1rc2") < Version("0.2.1")
    assert releases.sorted_versions(["0.2.1", "0.2.1rc1", "0.10.0", "0.2.0"]) == [
        "0.2.0", "0.2.1rc1", "0.2.1", "0.10.0",
    ]  # fmt: skip


def test_a_small_fix_after_a_release_is_numbered_as_an_rc_of_the_next_patch():
    assert releases.next_rc("0.2.0") == "0.2.1rc1"
    assert releases.next_rc("0.2.1rc1") == "0.2.1rc2"
    assert Version(releases.next_rc("0.2.0")) > Version("0.2.0")


def test_the_version_is_pep_440_and_lives_in_one_place():
    assert str(Version(llmgw.__version__)) == llmgw.__version__
    assert installed_version("llmgw") == llmgw.__version__


def test_release_notes_are_the_unreleased_section_under_the_version():
    changelog = "# Changelog\n\n## Unreleased\n\n### Fixed\n- a thing\n\n## 0.1.0\n- old\n"
    assert releases.notes(changelog, "0.2.0") == "# llmgw 0.2.0\n\n### Fixed\n- a thing\n"


def test_a_changelog_with_nothing_unreleased_makes_no_release():
    with pytest.raises(releases.ChangelogError, match="Unreleased"):
        releases.notes("# Changelog\n\n## Unreleased\n\n## 0.1.0\n- old\n", "0.2.0")


def test_the_project_changelog_has_release_notes():
    assert releases.unreleased((ROOT / "CHANGELOG.md").read_text())


def test_the_release_directory_lists_versions_in_pep_440_order_and_knows_the_newest(tmp_path):
    d = releases.ReleaseDir(tmp_path)
    for v in ("0.2.1", "0.2.0", "0.2.1rc1"):
        release, new = publish(d, v)
        assert new and release.version == Version(v)
    assert [str(r.version) for r in d.releases()] == ["0.2.0", "0.2.1rc1", "0.2.1"]
    assert str(d.newest().version) == "0.2.1"
    publish(d, "0.2.2rc1")
    assert str(d.newest().version) == "0.2.2rc1"
    assert str(d.newest(pre=False).version) == "0.2.1"


def test_publishing_the_same_wheel_twice_changes_nothing(tmp_path):
    d = releases.ReleaseDir(tmp_path)
    first, _ = publish(d, "0.2.0")
    again, new = publish(d, "0.2.0", now=2000.0)
    assert not new and again == first


def test_a_different_wheel_for_a_published_version_is_refused_naming_the_next_rc(tmp_path):
    d = releases.ReleaseDir(tmp_path)
    publish(d, "0.2.0")
    with pytest.raises(Conflict, match="0.2.1rc1"):
        publish(d, "0.2.0", wheel_bytes("0.2.0", extra=b"changed"))
    assert len(d.releases()) == 1


@pytest.mark.parametrize(
    "filename, data, words",
    [
        ("requests-2.0-py3-none-any.whl", wheel_bytes("2.0"), "not of llmgw"),
        ("llmgw.tar.gz", wheel_bytes("0.2.0"), "not a wheel file name"),
        ("llmgw-0.2.0-py3-none-any.whl", b"not a zip", "not a wheel"),
        ("llmgw-0.2.0-py3-none-any.whl", wheel_bytes("0.1.0"), "METADATA says llmgw 0.1.0"),
        ("llmgw-0.2.0-py3-none-any.whl", wheel_bytes("0.2.0", name="other"), "METADATA"),
    ],
)
def test_what_is_not_an_llmgw_wheel_of_its_version_is_refused(tmp_path, filename, data, words):
    d = releases.ReleaseDir(tmp_path / "releases")
    with pytest.raises(Invalid, match=words):
        d.publish(filename, io.BytesIO(data), len(data), 1000.0)
    assert d.releases() == []
    assert not d.path.exists() or list(d.path.iterdir()) == []


def test_an_upload_that_ends_short_leaves_nothing_behind(tmp_path):
    d = releases.ReleaseDir(tmp_path / "releases")
    data = wheel_bytes("0.2.0")
    with pytest.raises(Invalid, match="short"):
        d.publish("llmgw-0.2.0-py3-none-any.whl", io.BytesIO(data[:10]), len(data), 1000.0)
    assert list(d.path.iterdir()) == []


def test_no_release_is_a_one_line_refusal_saying_how_to_make_one(tmp_path):
    with pytest.raises(NotFound, match="make release"):
        releases.ReleaseDir(tmp_path / "none").newest()


def test_make_release_builds_the_wheel_sdist_and_notes_of_the_one_version(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "release.py"), "--outdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    v = llmgw.__version__
    wheel = tmp_path / f"llmgw-{v}-py3-none-any.whl"
    assert wheel.exists() and (tmp_path / f"llmgw-{v}.tar.gz").exists()
    assert releases.wheel_version(wheel.name) == Version(v)
    notes = (tmp_path / f"llmgw-{v}.notes.md").read_text()
    assert notes.startswith(f"# llmgw {v}\n") and "### " in notes
    # What a node installs is a wheel the release directory takes as it is.
    d = releases.ReleaseDir(tmp_path / "releases")
    with open(wheel, "rb") as f:
        release, new = d.publish(wheel.name, f, wheel.stat().st_size, 1000.0)
    assert new and str(release.version) == v
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmgw/example.toml" in names and "llmgw_agentd/main.py" in names
