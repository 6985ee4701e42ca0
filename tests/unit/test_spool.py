"""The usage spool: rows on local disk before the store, committed, removed, replayed
after a crash without duplicates; torn lines, broken disks and a second router."""

import logging
import os
import time

import pytest

from llmgw.store import Usage, migrate, open_store
from llmgw_router import spool as spoolmod
from llmgw_router.spool import Spool, SpoolLocked
from llmgw_router.usage import UsageRow, UsageWriter


def row(rid: str, status: int = 200) -> UsageRow:
    return UsageRow(time.time(), rid, "key_x", "m", served_model="m", endpoint="e0",
                    prompt_tokens=5, completion_tokens=7, status=status, latency_ms=12.5,
                    ttft_ms=3.0)  # fmt: skip


@pytest.fixture
def db(store_url):
    db = open_store(store_url)
    migrate(db)
    yield db
    db.close()


def make(directory, db, **kw):
    errors = []
    sp = Spool(directory, on_error=errors.append)
    sp.open()
    return UsageWriter(db, spool=sp, **kw), sp, errors


def crash(sp: Spool) -> None:
    """What kill -9 leaves: the files as they are, the descriptors closed by the kernel."""
    if sp._fd is not None:
        os.close(sp._fd)
    os.close(sp._lock_fd)


def request_ids() -> list[str]:
    return sorted(r.request_id for r in Usage.select(Usage.request_id))


def lines_on_disk(directory) -> int:
    return sum(p.read_bytes().count(b"\n") for p in directory.glob("usage-*.spool"))


def test_a_recorded_row_is_on_disk_at_once_and_gone_from_it_once_committed(tmp_path, db):
    writer, sp, errors = make(tmp_path / "spool", db)
    writer.record(row("r1"))
    writer.record(row("r2"))
    assert lines_on_disk(sp.dir) == 2
    assert writer.pending() == 2 and Usage.select().count() == 0
    assert writer.flush() == 2
    assert request_ids() == ["r1", "r2"]
    assert lines_on_disk(sp.dir) == 0 and writer.pending() == 0
    assert len(list(sp.dir.glob("usage-*.spool"))) == 1  # only the open, empty segment
    assert errors == []


def test_rows_recorded_after_a_rotation_wait_in_the_next_segment(tmp_path, db):
    writer, sp, _ = make(tmp_path / "spool", db)
    writer.record(row("r1"))
    sp.rotate()  # the writer has closed the segment and is committing it...
    writer.record(row("r2"))  # ...while the event loop records another
    [first] = sp.closed()
    writer._insert(first.load()[0])
    sp.remove(first)
    assert request_ids() == ["r1"]
    assert lines_on_disk(sp.dir) == 1
    assert writer.flush() == 1
    assert request_ids() == ["r1", "r2"]


def test_an_idle_writer_neither_rotates_nor_touches_the_store(tmp_path, db):
    writer, sp, _ = make(tmp_path / "spool", db)
    before = sorted(sp.dir.glob("usage-*.spool"))
    db.close()
    assert writer.flush() == 0
    assert db.is_closed()  # no query, so no connection
    assert sorted(sp.dir.glob("usage-*.spool")) == before


def test_a_spool_left_by_a_crash_is_replayed_at_start_without_duplicates(tmp_path, db, caplog):
    writer, sp, _ = make(tmp_path / "spool", db)
    for i in range(5):
        writer.record(row(f"r{i}"))
    # The writer committed the segment and the router died before removing it...
    sp.rotate()
    [segment] = sp.closed()
    writer._insert(segment.load()[0])
    for i in range(5, 8):
        writer.record(row(f"r{i}"))  # ...with these not committed at all.
    crash(sp)
    caplog.set_level(logging.INFO)
    again, sp2, _ = make(tmp_path / "spool", db)
    assert len(sp2.leftover) == 2
    assert again.flush() == 8  # all of both segments are offered to the store again
    assert request_ids() == [f"r{i}" for i in range(8)]  # each once
    assert again.replayed == 8 and again.pending() == 0
    assert lines_on_disk(sp2.dir) == 0
    assert sum("usage_spool_replayed" in r.getMessage() for r in caplog.records) == 2


def test_a_torn_last_line_is_skipped_with_a_log_line(tmp_path, db, caplog):
    directory = tmp_path / "spool"
    directory.mkdir()
    good = spoolmod.encode(row("r1").values("id-1")) + spoolmod.encode(row("r2").values("id-2"))
    torn = spoolmod.encode(row("r3").values("id-3"))[:40]  # the write a crash cut short
    (directory / "usage-00000007.spool").write_bytes(good + torn)
    caplog.set_level(logging.INFO)
    writer, sp, _ = make(directory, db)
    assert writer.flush() == 2
    assert request_ids() == ["r1", "r2"]
    [torn_line] = [
        r.getMessage() for r in caplog.records if "usage_spool_torn_line" in r.getMessage()
    ]
    assert "segment=usage-00000007.spool" in torn_line and "bytes=40" in torn_line
    assert "skipped_lines=1" in next(
        r.getMessage() for r in caplog.records if "usage_spool_replayed" in r.getMessage()
    )
    # The new run's segments are numbered after what it found.
    assert sp._active.path.name == "usage-00000008.spool"


def test_an_unwritable_spool_directory_is_counted_and_its_rows_wait_in_memory(tmp_path, db):
    (tmp_path / "a-file").write_text("")
    sp = Spool(tmp_path / "a-file" / "spool", on_error=(errors := []).append)
    with pytest.raises(OSError):
        sp.open()
    writer = UsageWriter(db, spool=sp)
    writer.record(row("r1"))
    writer.record(row("r2"))
    assert sum(errors) == 2 and writer.pending() == 2
    assert writer.flush() == 2  # the store still gets them
    assert request_ids() == ["r1", "r2"]


def test_a_full_disk_is_logged_once_counted_and_the_next_segment_takes_rows_again(
    tmp_path, db, caplog
):
    writer, sp, errors = make(tmp_path / "spool", db)
    os.close(sp._fd)
    sp._fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    caplog.set_level(logging.INFO)
    for i in range(3):
        writer.record(row(f"r{i}"))
    assert sum(errors) == 3
    failed = [r.getMessage() for r in caplog.records if "usage_spool_failed" in r.getMessage()]
    assert len(failed) == 1 and "No space left on device" in failed[0]
    assert writer.pending() == 3  # in memory
    writer.flush()  # reopens a segment, and writes the three from memory
    writer.record(row("r3"))
    assert lines_on_disk(sp.dir) == 1 and sum(errors) == 3
    assert sum("usage_spool_recovered" in r.getMessage() for r in caplog.records) == 1
    writer.flush()
    assert request_ids() == ["r0", "r1", "r2", "r3"]


def test_a_second_router_on_the_same_spool_is_refused_naming_the_first(tmp_path):
    first = Spool(tmp_path / "spool")
    first.open()
    with pytest.raises(SpoolLocked, match=f"in use by another router \\(pid {os.getpid()}\\)"):
        Spool(tmp_path / "spool").open()
    first.close()
    Spool(tmp_path / "spool").open()  # free once the first let go


def test_stop_writes_what_is_spooled_and_leaves_an_empty_directory(tmp_path, db):
    writer, sp, _ = make(tmp_path / "spool", db, flush_s=3600.0)
    writer.start()
    writer.record(row("r1"))
    writer.stop()
    assert request_ids() == ["r1"]
    assert list(sp.dir.glob("usage-*.spool")) == []


def test_rows_left_when_the_store_is_down_at_exit_stay_in_the_spool(tmp_path, db):
    writer, sp, _ = make(tmp_path / "spool", db)
    writer.record(row("r1"))
    writer._sql = writer._sql.replace("INSERT INTO usage", "INSERT INTO no_such_table")
    writer._last_tick()
    assert lines_on_disk(sp.dir) == 1
    again, _, _ = make(tmp_path / "spool", db)  # the lock was let go
    assert again.flush() == 1
    assert request_ids() == ["r1"]


def test_a_spool_left_by_a_router_from_before_the_api_column_is_replayed_without_it(tmp_path, db):
    directory = tmp_path / "spool"
    directory.mkdir()
    # A line as a router before m014 wrote it: no api after its row_id.
    old = spoolmod.encode(row("old").values("oldrouter1")[:-1])
    (directory / "usage-00000001.spool").write_bytes(old)
    writer, sp, _ = make(directory, db)
    new = row("new")
    new.api = "/v1/messages"
    writer.record(new)
    writer.flush()
    apis = {r.request_id: r.api for r in Usage.select(Usage.request_id, Usage.api)}
    assert apis == {"new": "/v1/messages", "old": None}


def test_rows_past_what_memory_holds_are_read_back_from_disk(tmp_path, db, monkeypatch):
    monkeypatch.setattr(spoolmod, "HELD_ROWS", 3)
    writer, sp, _ = make(tmp_path / "spool", db)
    for i in range(2):
        writer.record(row(f"a{i}"))
    sp.rotate()
    for i in range(2):  # the fourth row is past HELD_ROWS: this segment is read from disk
        writer.record(row(f"b{i}"))
    sp.rotate()
    first, second = sp.closed()
    assert first.rows is not None and len(first.rows) == 2
    assert second.rows is None
    assert writer.flush() == 4
    assert request_ids() == ["a0", "a1", "b0", "b1"]
    assert sp._held == 0  # what was committed is let go
    writer.record(row("c0"))  # and memory takes rows again
    assert sp._active.rows is not None and len(sp._active.rows) == 1


def test_a_spool_line_is_the_json_of_its_row():
    import json

    odd = (1.5, 'quote " and \\ and é', None, 7, 0.1 + 0.2, "", "ünïcode ☃")
    line = spoolmod.encode(odd)
    assert line == (json.dumps(odd, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    assert tuple(json.loads(line)) == odd
