"""llmgw-backup end to end: the real executable, real SQLite files, a real PostgreSQL."""

import io
import json
import stat
import tarfile
from pathlib import Path

from llmgw import backups as archive
from tests.backup.conftest import backup, engine_secret, failed_with_one_line, ok
from tests.helpers import llmgw


def keys_in(url: str) -> list[str]:
    out = llmgw("keys", "list", "--store", "--all", "--json", env={"LLMGW_STORE": url}).stdout
    return [k["id"] for k in json.loads(out)]


def test_a_backup_is_one_private_archive_in_a_listable_directory(seeded, backups):
    result = json.loads(ok(backup("run", "--json")).stdout)
    path = backups / result["name"]
    assert archive.PATTERN.match(path.name) and result["path"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(backups.stat().st_mode) == 0o755
    assert result["bytes"] == path.stat().st_size and len(result["sha256"]) == 64
    assert result["duration_s"] >= 0
    assert sorted(p.name for p in backups.iterdir()) == [path.name]  # no .part, no staging
    with tarfile.open(path) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("MANIFEST.json"))
    assert "config/llmgw.toml" in names and "config/pki/ca.key" in names
    assert manifest["store"]["kind"] == ("sqlite" if "sqlite" in seeded["url"] else "postgresql")
    assert {f["path"] for f in manifest["files"]} == set(names) - {
        "MANIFEST.json",
        "config",
        "config/pki",
    }


def test_an_archive_verifies_and_restores_into_an_empty_store_with_the_same_keys_and_secret(
    seeded, backups, empty_store, config_dir
):
    path = ok(backup("run")).stdout.strip()
    verified = json.loads(ok(backup("verify", path, "--json")).stdout)
    assert verified["ok"] and verified["api_keys"] == 1 and verified["engine_secret"]
    (config_dir / "pki" / "ca.key").unlink()

    restored = ok(
        backup(
            "restore", path, "--config-to", config_dir, "--json", env={"LLMGW_STORE": empty_store}
        )
    )

    assert str(config_dir / "pki" / "ca.key") in json.loads(restored.stdout)["config_written"]
    assert keys_in(empty_store) == [seeded["key_id"]]
    assert engine_secret(empty_store) == seeded["engine_secret"]
    assert stat.S_IMODE((config_dir / "pki" / "ca.key").stat().st_mode) == 0o600


def test_restore_refuses_a_store_that_is_not_empty_until_forced(seeded, backups):
    path = ok(backup("run")).stdout.strip()
    llmgw("keys", "create", "--store", "--name", "after-backup")

    error = failed_with_one_line(backup("restore", path))

    assert "is not empty (tables: " in error and "--force" in error
    assert len(keys_in(seeded["url"])) == 2  # nothing was touched
    ok(backup("restore", path, "--force"))
    assert keys_in(seeded["url"]) == [seeded["key_id"]]
    assert engine_secret(seeded["url"]) == seeded["engine_secret"]


def test_restore_refuses_to_overwrite_a_changed_config_file_until_forced(
    seeded, backups, empty_store, config_dir
):
    path = ok(backup("run")).stdout.strip()
    original = (config_dir / "llmgw.toml").read_text()
    (config_dir / "llmgw.toml").write_text(original + "\n# changed after the backup\n")

    to = ("--config-to", config_dir)
    error = failed_with_one_line(backup("restore", path, *to, env={"LLMGW_STORE": empty_store}))

    assert str(config_dir / "llmgw.toml") in error and "--force" in error
    assert keys_in(empty_store) == []  # refused before the store was touched
    ok(backup("restore", path, *to, "--force", env={"LLMGW_STORE": empty_store}))
    assert (config_dir / "llmgw.toml").read_text() == original


def test_a_restore_into_a_scratch_store_never_touches_the_live_configuration(
    seeded, backups, empty_store, config_dir
):
    path = ok(backup("run")).stdout.strip()
    live = (config_dir / "llmgw.toml").read_text() + "\n# changed after the backup\n"
    (config_dir / "llmgw.toml").write_text(live)
    (config_dir / "pki" / "ca.key").unlink()

    out = ok(backup("restore", path, env={"LLMGW_STORE": empty_store})).stdout

    assert keys_in(empty_store) == [seeded["key_id"]]
    assert "configuration files were not restored" in out and "--config-to" in out
    assert (config_dir / "llmgw.toml").read_text() == live
    assert not (config_dir / "pki" / "ca.key").exists()


def test_the_configuration_can_be_restored_beside_the_live_one(
    seeded, backups, empty_store, config_dir, tmp_path
):
    path = ok(backup("run")).stdout.strip()
    aside = tmp_path / "restored-config"

    result = json.loads(
        ok(
            backup(
                "restore", path, "--config-to", aside, "--json", env={"LLMGW_STORE": empty_store}
            )
        ).stdout
    )

    assert (aside / "llmgw.toml").read_bytes() == (config_dir / "llmgw.toml").read_bytes()
    assert str(aside / "pki" / "ca.key") in result["config_written"]


def test_a_backup_whose_store_dump_fails_leaves_no_archive_behind(config_dir, backups):
    bad = "postgresql://llmgw:hunter2@127.0.0.1:1/llmgw"  # nothing listens on port 1

    error = failed_with_one_line(backup("run", env={"LLMGW_STORE": bad}))

    assert "pg_dump of postgresql://llmgw:***@127.0.0.1:1/llmgw failed" in error
    assert "hunter2" not in error
    assert list(backups.iterdir()) == []  # no archive, no .part file, no staging directory


def test_a_backup_of_a_sqlite_store_that_does_not_exist_fails_in_one_line(config_dir, tmp_path):
    missing = f"sqlite://{tmp_path}/nowhere/llmgw.db"

    error = failed_with_one_line(backup("run", env={"LLMGW_STORE": missing}))

    assert "does not exist" in error
    assert not (tmp_path / "nowhere").exists()  # and was not created by looking


def test_pruning_keeps_the_newest_n_and_never_touches_part_or_foreign_files(seeded, backups):
    backups.mkdir()
    old = ["llmgw-20200101T000000Z.tar.gz", "llmgw-20200102T000000Z.tar.gz"]
    old.append("llmgw-20200103T000000Z.tar.gz")
    foreign = [
        "llmgw-20200104T000000Z.tar.gz.part",  # another run, still writing
        "llmgw-20200101T000000Z.tar.gz.bak",
        "llmgw-latest.tar.gz",
        "notes.txt",
    ]
    for name in old + foreign:
        (backups / name).write_text("x")

    result = json.loads(ok(backup("run", "--keep", "2", "--json")).stdout)

    assert [a.path.name for a in archive.archives(backups)] == [result["name"], old[2]]
    assert sorted(result["pruned"]) == [str(backups / old[0]), str(backups / old[1])]
    assert all((backups / name).exists() for name in foreign)


def test_keep_zero_keeps_every_archive(seeded, backups):
    backups.mkdir()
    (backups / "llmgw-20200101T000000Z.tar.gz").write_text("x")

    ok(backup("run", "--keep", "0"))

    assert len(archive.archives(backups)) == 2


def test_list_shows_archives_newest_first(seeded, backups, tmp_path):
    backups.mkdir()
    (backups / "llmgw-20200101T000000Z.tar.gz").write_text("x")
    path = ok(backup("run")).stdout.strip()

    listed = json.loads(ok(backup("list", "--json")).stdout)
    table = ok(backup()).stdout.splitlines()

    assert [a["path"] for a in listed] == [path, str(backups / "llmgw-20200101T000000Z.tar.gz")]
    assert listed[1]["created_at"] == 1577836800.0
    assert table[0].split() == ["PATH", "SIZE", "CREATED"] and table[1].startswith(path)


def test_verify_fails_for_a_store_without_the_engine_key_secret(config_dir, backups):
    llmgw("keys", "create", "--store", "--name", "no-scheduler-yet")  # the scheduler never ran
    path = ok(backup("run")).stdout.strip()

    error = failed_with_one_line(backup("verify", path))

    assert "no engine-key secret" in error


def test_verify_fails_for_an_archive_changed_after_it_was_written(seeded, backups, tmp_path):
    path = ok(backup("run")).stdout.strip()
    tampered = tmp_path / "tampered.tar.gz"
    with tarfile.open(path) as src, tarfile.open(tampered, "w:gz") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isfile() else None
            if info.name == "config/llmgw.toml":
                data = data.replace(b"state", b"STATE")
            dst.addfile(info, io.BytesIO(data) if data is not None else None)

    error = failed_with_one_line(backup("verify", str(tampered)))

    assert "config/llmgw.toml does not match its sha256" in error


def test_verify_fails_for_a_truncated_archive(seeded, backups, tmp_path):
    path = ok(backup("run")).stdout.strip()
    short = tmp_path / "short.tar.gz"
    data = Path(path).read_bytes()
    short.write_bytes(data[: len(data) // 2])

    error = failed_with_one_line(backup("verify", str(short)))

    assert "truncated" in error
