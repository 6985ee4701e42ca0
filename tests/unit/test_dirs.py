import errno
import os
from pathlib import Path

import pytest

from llmgw import dirs


def test_a_directory_that_cannot_be_made_names_it_its_missing_parents_and_the_command():
    e = PermissionError(errno.EACCES, "Permission denied", "/etc/llmgw/pki")
    message = str(dirs.cannot_write(Path("/nowhere/pki/curve"), e, "keys"))
    assert message.startswith("cannot write keys in /nowhere/pki/curve: /etc/llmgw/pki: ")
    assert "Permission denied" in message
    # install -d gives the owner to the last directory only: each missing one is named.
    user, group = dirs.identity()
    assert f"install -d -o {user} -g {group} -m 0750 /nowhere /nowhere/pki /nowhere/pki/curve" in (
        message
    )
    assert "\n" not in message


def test_a_read_only_directory_points_at_the_unit_s_write_paths(tmp_path):
    e = OSError(errno.EROFS, "Read-only file system", str(tmp_path))
    message = str(dirs.cannot_write(tmp_path, e))
    assert message.startswith(f"cannot write {tmp_path}: Read-only file system")
    assert "ReadWritePaths" in message and f"-m 0750 {tmp_path}`" in message


def test_a_missing_directory_is_made_once_and_then_left_as_it_is(tmp_path):
    target = tmp_path / "a" / "b"
    assert dirs.writable(target) == target
    assert target.is_dir() and target.stat().st_mode & 0o777 == 0o750 & ~_umask()
    target.chmod(0o700)
    dirs.writable(target)
    assert target.stat().st_mode & 0o777 == 0o700


def test_a_file_where_the_directory_should_be_is_one_error_naming_it(tmp_path):
    (tmp_path / "state").write_text("not a directory")
    with pytest.raises(dirs.DirError, match=rf"cannot write the store in {tmp_path}/state: "):
        dirs.writable(tmp_path / "state", "the store")


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
