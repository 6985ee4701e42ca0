"""llmgw-backup's parts on their own: names, pruning, pg_dump's argv and env, the bundle."""

import io
import json
import os
import sys
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmgw import backups as archive
from llmgw_backup import bundle, postgres
from llmgw_backup.errors import ArchiveError, BackupError
from tests.backup.conftest import backup, ok


def _touch(directory: Path, *names: str) -> None:
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_text("x")


def test_an_archive_is_named_for_the_utc_time_of_its_run():
    when = datetime(2025, 3, 4, 5, 6, 7, tzinfo=UTC)
    name = archive.name_for(when)
    assert name == "llmgw-20250304T050607Z.tar.gz"
    assert archive.created_at(name) == when.timestamp()
    assert archive.created_at(name + ".part") is None


def test_newest_is_the_latest_archive_by_name_with_its_mtime(tmp_path):
    assert archive.newest(tmp_path / "missing") is None
    _touch(tmp_path, "llmgw-20250101T000000Z.tar.gz", "llmgw-20250102T000000Z.tar.gz")
    _touch(tmp_path, "llmgw-20250103T000000Z.tar.gz.part", "llmgw-20991231T000000Z.tgz")
    os.utime(tmp_path / "llmgw-20250102T000000Z.tar.gz", (1000, 1000))

    assert archive.newest(tmp_path) == (tmp_path / "llmgw-20250102T000000Z.tar.gz", 1000)


def test_the_archive_just_written_survives_pruning_even_if_the_clock_stepped_back(tmp_path):
    names = ["llmgw-20250101T000000Z.tar.gz", "llmgw-20250102T000000Z.tar.gz"]
    names.append("llmgw-20250103T000000Z.tar.gz")
    _touch(tmp_path, *names)
    just_written = tmp_path / names[0]

    gone = archive.prune(tmp_path, keep=2, protect=just_written)

    assert gone == [tmp_path / names[1]]
    assert just_written.exists() and (tmp_path / names[2]).exists()


def test_a_password_reaches_pg_dump_only_through_its_environment():
    url = "postgresql://llmgw:p%40ss%3Aword@db1.example:5433/llmgw_prod"

    env = postgres.conn_env(url)
    argvs = [
        postgres.dump_argv(Path("/tmp/out.pgdump")),
        *postgres.restore_argvs(Path("/tmp/d"), Path("/tmp/s.sql"), env["PGDATABASE"], ["usage"]),
    ]

    assert env == {
        "PGHOST": "db1.example",
        "PGPORT": "5433",
        "PGUSER": "llmgw",
        "PGPASSWORD": "p@ss:word",
        "PGDATABASE": "llmgw_prod",
    }
    for argv in argvs:
        assert not any("p@ss" in a or "ss%3A" in a or "://" in a for a in argv), argv


def test_a_url_without_host_or_password_leaves_them_to_libpq():
    assert postgres.conn_env("postgresql:///llmgw") == {"PGDATABASE": "llmgw"}
    assert postgres.conn_env("postgresql://[::1]:5432/x")["PGHOST"] == "::1"


def test_the_real_executable_calls_pg_dump_with_the_password_in_the_environment(
    tmp_path, monkeypatch
):
    (tmp_path / "etc" / "pki").mkdir()
    record = tmp_path / "pg_dump.json"
    fake = tmp_path / "bin" / "pg_dump"
    fake.parent.mkdir()
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv, 'env': {{k: v for k, v in os.environ.items()"
        f" if k.startswith('PG')}}}}, open({str(record)!r}, 'w'))\n"
        "out = [a for a in sys.argv if a.startswith('--file=')][0][len('--file='):]\n"
        "open(out, 'wb').write(b'PGDMP')\n"
    )
    fake.chmod(0o755)
    url = "postgresql://llmgw:hunter2@db1.example:5432/llmgw"
    env = {"LLMGW_STORE": url, "PATH": f"{fake.parent}:{os.environ['PATH']}"}

    path = ok(backup("run", env=env)).stdout.strip()

    seen = json.loads(record.read_text())
    assert not any("hunter2" in a for a in seen["argv"])
    assert seen["env"]["PGPASSWORD"] == "hunter2" and seen["env"]["PGHOST"] == "db1.example"
    with tarfile.open(path) as tar:
        manifest = tar.extractfile("MANIFEST.json").read().decode()
    assert "hunter2" not in manifest and "llmgw:***@db1.example" in manifest


def test_copy_rows_reads_the_data_pg_restore_prints():
    sql = (
        "SET statement_timeout = 0;\n"
        "COPY public.cluster_secrets (name, value, created_at) FROM stdin;\n"
        "engine_keys\tabc\t1.5\n"
        "\\.\n"
        "COPY public.api_keys (id, name) FROM stdin;\n"
        "\\.\n"
    )
    assert postgres.copy_rows(sql) == {
        "cluster_secrets": [["engine_keys", "abc", "1.5"]],
        "api_keys": [],
    }


def _member(name: str, data: bytes) -> bundle.Member:
    return bundle.Member(name, 0o600, 0, data=data)


def test_a_write_that_fails_leaves_neither_the_archive_nor_its_part_file(tmp_path):
    out = tmp_path / "backups"
    out.mkdir()
    final = out / "llmgw-20250101T000000Z.tar.gz"
    members = [_member("config/a", b"a"), bundle.Member("store/llmgw.db", 0o600, 0)]
    members[1].source = tmp_path / "vanished.db"  # the dump is gone before it is added
    manifest = {"created_at": 0, "files": []}

    with pytest.raises(FileNotFoundError):
        bundle.write(final, manifest, members)

    assert list(out.iterdir()) == []


def test_a_write_never_replaces_an_archive_of_the_same_name(tmp_path):
    out = tmp_path / "backups"
    out.mkdir()
    final = out / "llmgw-20250101T000000Z.tar.gz"
    final.write_text("the first run's")

    with pytest.raises(BackupError, match="already exists"):
        bundle.write(final, {"created_at": 0, "files": []}, [_member("config/a", b"a")])

    assert final.read_text() == "the first run's"
    assert sorted(p.name for p in out.iterdir()) == [final.name]


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "elsewhere/file"])
def test_an_archive_with_a_path_outside_its_layout_is_refused(tmp_path, name):
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))

    with pytest.raises(ArchiveError):
        bundle.extract(evil, tmp_path / "out")

    assert not (tmp_path / "escape").exists()
