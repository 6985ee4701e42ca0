"""The usage spool: each finished request's row, on local disk before the store sees it.

kill -9 of a router under load lost 1,650 of 8,280 usage rows for answers the clients
had received in full: everything in the batch buffer was gone. Usage is what people
are billed on. So the request path appends its row to a segment file with one
`write()` on an O_APPEND descriptor (the kernel keeps it through a process crash) and
never waits on the store. The usage writer closes the segment now and then (`rotate`),
commits its rows, and only then removes it; a router that starts replays the segments
an earlier run left. Rows carry their own id, so a segment committed but not yet
removed when the router died is inserted again without duplicates.

The writer takes a segment's rows from memory: the spool keeps what it appended (up to
HELD_ROWS, so a long store outage holds them on disk only), and reads from disk only
what an earlier run left or what memory did not keep. Reading every row back cost the
writer's thread more CPU than the rest of its work.

A directory holds one router's spool: `usage-NNNNNNNN.spool` segments and a `lock`
file held with flock for the router's life, so a second router pointed at the same
directory refuses to start instead of committing (and removing) the first one's rows.
"""

import fcntl
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from llmgw import log
from llmgw.errors import Error

_log = log.get("llmgw.router.spool")

_PREFIX, _SUFFIX = "usage-", ".spool"
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _refuse(o):
    raise TypeError(f"a usage row holds a {type(o).__name__}, which JSON cannot")


# json's C encoder, made once: JSONEncoder.encode makes one for every call, which was
# two thirds of a spool line's cost. The same text as _encode.
_c_encoder = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, _refuse, json.encoder.encode_basestring, None, ":", ",", False, False, True
)

# Rows of closed and open segments kept in memory for the writer, at most; past it a
# segment's rows are read back from disk.
HELD_ROWS = 200_000


class SpoolLocked(Error):
    """Another live router holds this spool directory."""


def encode(row: tuple) -> bytes:
    """One spool line: the row as a JSON array, and a newline."""
    if _c_encoder is not None:
        return ("".join(_c_encoder(row, 0)) + "\n").encode()
    return (_encode(row) + "\n").encode()


def read(path: Path) -> tuple[list[tuple], int]:
    """The rows of a segment, and how many lines could not be read (a torn last line
    after a crash or a short write on a full disk; a corrupt line)."""
    data = path.read_bytes()
    rows, bad = [], 0
    lines = data.split(b"\n")
    # After the last newline: empty, or a write the crash (or a full disk) cut short.
    tail = lines.pop()
    if tail:
        bad += 1
        _log.warning("usage_spool_torn_line", segment=path.name, bytes=len(tail))
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, list):
            bad += 1
            _log.warning("usage_spool_bad_line", segment=path.name, line=n, bytes=len(line))
            continue
        rows.append(tuple(row))
    return rows, bad


@dataclass(slots=True, eq=False)
class Segment:
    """A segment file, and its rows when this run wrote and kept them (None: read the
    file)."""

    path: Path
    rows: list[tuple] | None = None

    def load(self) -> tuple[list[tuple], int]:
        """Its rows, and how many lines could not be read (see read())."""
        if self.rows is not None:
            return self.rows, 0
        return read(self.path)


class Spool:
    """One router's spool directory: the open segment rows are appended to (on the event
    loop), and the closed ones the usage writer commits and removes (on its thread)."""

    def __init__(self, directory: Path, on_error=None):
        self.dir = Path(directory)
        self.on_error = on_error or (lambda n: None)  # rows that could not be spooled
        self._lock = threading.Lock()  # an append and a rotation never interleave
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._active: Segment | None = None
        self._active_rows = 0  # lines written to it, whole or torn
        self._held = 0  # rows kept in memory, of every segment
        self._seq = 0
        self._closed: list[Segment] = []  # oldest first
        self._failing = False
        self.leftover: list[Segment] = []  # what an earlier run left, found by open()

    # -- start and stop (the writer's side) ------------------------------------------

    def open(self) -> None:
        """Take the directory, find what an earlier run left and open a fresh segment.

        Raises SpoolLocked if another router holds it; OSError if it cannot be made or
        locked (the caller runs without a spool then)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SpoolLocked(
                f"usage spool {self.dir} is in use by another router (pid {holder}); "
                "give each router its own router.usage_spool_dir"
            ) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        found = []
        for p in self.dir.glob(f"{_PREFIX}*{_SUFFIX}"):
            try:
                found.append((int(p.name[len(_PREFIX) : -len(_SUFFIX)]), p))
            except ValueError:
                continue  # not one of ours
        found.sort()
        self.leftover = [Segment(p) for _, p in found]
        self._closed = list(self.leftover)
        self._seq = found[-1][0] if found else 0
        with self._lock:
            self._open_segment()

    def close(self) -> None:
        """Close the open segment (removed if empty) and let the directory go."""
        with self._lock:
            fd, active, rows = self._fd, self._active, self._active_rows
            self._fd = self._active = None
        if fd is not None:
            os.close(fd)
            if rows == 0 and active is not None:
                active.path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the request path ---------------------------------------------------------------

    def append(self, row: tuple) -> bool:
        """Append one row's line with one write(). False: it is not on disk (the spool is
        broken or the disk full): logged once, counted, and the caller keeps the row."""
        line = encode(row)
        with self._lock:
            fd = self._fd
            if fd is None:
                self.on_error(1)
                return False
            try:
                n = os.write(fd, line)
            except OSError as e:
                self._broken(e)
                return False
            if n != len(line):
                # A full disk took part of the line: the segment ends torn, the reader
                # skips that line, and later rows go to a fresh segment.
                self._active_rows += 1  # the fragment: the segment must be read
                self._broken(OSError(f"short write: {n} of {len(line)} bytes"))
                return False
            self._active_rows += 1
            kept = self._active.rows
            if kept is not None:
                if self._held < HELD_ROWS:
                    kept.append(row)
                    self._held += 1
                else:  # memory is full: this segment is read from disk
                    self._held -= len(kept)
                    self._active.rows = None
        if self._failing:
            self._failing = False
            _log.info("usage_spool_recovered", dir=str(self.dir))
        return True

    def _broken(self, e: OSError) -> None:
        """Close the open segment (the writer reads what it holds) until the writer opens
        another; meanwhile rows are not spooled. Called with the lock held."""
        self.on_error(1)
        if not self._failing:
            self._failing = True
            _log.error(
                "usage_spool_failed",
                dir=str(self.dir),
                reason=e.strerror or str(e),
                action="rows kept in memory until written",
            )
        self._close_active()

    # -- the writer's side --------------------------------------------------------------

    def rotate(self) -> None:
        """Close the open segment if it holds rows, so the writer can commit it; reopen
        one after a failure."""
        with self._lock:
            if self._lock_fd is None or (self._fd is not None and self._active_rows == 0):
                return
            self._close_active()
            try:
                self._open_segment()
            except OSError as e:
                if not self._failing:
                    self._failing = True
                    _log.error("usage_spool_failed", dir=str(self.dir),
                               reason=e.strerror or str(e),
                               action="rows kept in memory until written")  # fmt: skip

    def closed(self) -> list[Segment]:
        """Segments ready to commit, oldest first."""
        with self._lock:
            return list(self._closed)

    def remove(self, segment: Segment) -> None:
        """A committed segment: its rows are in the store."""
        segment.path.unlink(missing_ok=True)
        with self._lock:
            self._closed.remove(segment)
            if segment.rows is not None:
                self._held -= len(segment.rows)
                segment.rows = None

    @property
    def held(self) -> bool:
        """This router holds the directory (open() succeeded)."""
        return self._lock_fd is not None

    def _open_segment(self) -> None:
        self._seq += 1
        path = self.dir / f"{_PREFIX}{self._seq:08d}{_SUFFIX}"
        self._fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o640
        )
        self._active, self._active_rows = Segment(path, []), 0

    def _close_active(self) -> None:
        fd, active, rows = self._fd, self._active, self._active_rows
        self._fd = self._active = None
        self._active_rows = 0
        if fd is None:
            return
        try:
            os.close(fd)
        except OSError:
            pass
        if active is None:
            return
        if rows:
            self._closed.append(active)
        else:
            active.path.unlink(missing_ok=True)
