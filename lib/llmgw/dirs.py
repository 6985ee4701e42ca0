"""The directories a tool writes, and the one line that says how to fix one it cannot.

Under its systemd unit a tool runs as `llmgw` with the file system read-only except its
state directory and the paths its unit lists (ReadWritePaths). A directory it cannot
write is an operator's step left out, so the error names the directory and the command
that makes it, never a traceback: docs/install.md says which tool writes which.
"""

import errno
import grp
import os
import pwd
from pathlib import Path

from llmgw.errors import Error


class DirError(Error):
    """A directory a tool must write is missing, read-only or not its own."""


def identity() -> tuple[str, str]:
    """This process's user and group names (numbers where they have none)."""
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        user = str(os.geteuid())
    try:
        group = grp.getgrgid(os.getegid()).gr_name
    except KeyError:
        group = str(os.getegid())
    return user, group


def _to_make(directory: Path) -> list[Path]:
    """`directory` and its missing parents, outermost first: `install -d` gives the owner
    and mode to the last one only."""
    todo = [directory]
    parent = directory.parent
    while parent != parent.parent and not os.path.exists(parent):
        todo.append(parent)
        parent = parent.parent
    return todo[::-1]


def cannot_write(directory: Path, e: OSError, what: str = "") -> DirError:
    """The error for an OSError met writing in `directory` (what: the file, for the message)."""
    user, group = identity()
    make = f"install -d -o {user} -g {group} -m 0750 {' '.join(map(str, _to_make(directory)))}"
    failed = Path(e.filename) if e.filename else directory
    if e.errno == errno.EROFS:
        fix = f"make it as root (`{make}`) and list it in the unit's ReadWritePaths"
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = f"run `{make}` as root"
    elif e.errno == errno.ENOSPC:
        fix = "free some space there"
    else:
        fix = f"it must be a directory {user} can write: `{make}`"
    where = f"{what} in {directory}" if what else str(directory)
    if failed != directory:
        where += f": {failed}"
    return DirError(f"cannot write {where}: {e.strerror or e} ({fix}; see docs/install.md)")


def writable(directory: Path, what: str = "") -> Path:
    """Make `directory` (0750) unless it is there, and check this process may write in it."""
    directory = Path(directory)
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as e:
        raise cannot_write(directory, e, what) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        # access() answers EROFS and EACCES alike as False: find out which.
        probe = directory / f".llmgw-write-probe-{os.getpid()}"
        try:
            probe.touch()
            probe.unlink()
        except OSError as e:
            e.filename = str(directory)  # the probe's name would only puzzle
            raise cannot_write(directory, e, what) from None
    return directory
