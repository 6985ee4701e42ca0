"""Usage rows: spooled to local disk on the request path, written to the store in
batches by a background worker.

The request path appends the row to the spool (`spool.py`: one write() on an O_APPEND
file) and moves on; it never waits on the store. Every `flush_s` the writer closes the
spool's open segment, commits its rows in batches of `batch`, and only then removes
the segment, so a crash loses no row the spool took. Each row has its own id
(`row_id`, unique in the store), so a segment committed twice — the router died
between the commit and the removal, and replays it at its next start — adds nothing.

Rows the spool cannot take (no spool, an unwritable directory, a full disk) wait in a
bounded buffer in memory, as every row did before the spool: they are written when the
store is up, and lost if the router crashes first. Only when that buffer is full are
new rows dropped, counted and logged. `stop()` writes what is left.
"""

import collections
import itertools
import secrets
import time
from dataclasses import dataclass

from llmgw import log
from llmgw.store import Usage
from llmgw.worker import Worker, first_line
from llmgw_router import spool as spoolmod

_log = log.get("llmgw.router.usage")

# Rows inserted at a time, after which the writer rests as long as they took: ~0.5 ms of
# a core on SQLite. The writer never takes more than half a core, and on a core the
# router keeps busy requests wait for it that long at most (writing a second's rows at
# once, it took the core in slices of a few milliseconds: p99 at concurrency 16 ~6 ms).
SLICE_ROWS = 64

FIELDS = (
    "at", "request_id", "key_id", "model", "served_model", "endpoint",
    "prompt_tokens", "completion_tokens", "status", "latency_ms", "ttft_ms",
    "user", "project", "team", "org", "cost", "row_id", "api", "cached_tokens",
)  # fmt: skip


@dataclass(slots=True)
class UsageRow:
    """One request's usage, as the request path knows it; the writer adds its row_id.
    (It was a positional 16-tuple: a field out of place went to the wrong column.)"""

    at: float
    request_id: str
    key_id: str | None
    model: str  # what was asked for
    served_model: str | None = None  # what answered (None: no engine did)
    endpoint: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 0
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    user: str | None = None
    project: str | None = None
    team: str | None = None
    org: str | None = None
    cost: float | None = None
    api: str | None = None  # the path it came by
    cached_tokens: int | None = None  # of prompt_tokens, reused from the engine's cache

    def values(self, row_id: str) -> tuple:
        """The row in FIELDS order: what the spool and the INSERT take."""
        return (
            self.at, self.request_id, self.key_id, self.model, self.served_model,
            self.endpoint, self.prompt_tokens, self.completion_tokens, self.status,
            self.latency_ms, self.ttft_ms, self.user, self.project, self.team, self.org,
            self.cost, row_id, self.api, self.cached_tokens,
        )  # fmt: skip


class UsageWriter:
    def __init__(
        self,
        db,
        capacity=100_000,
        batch=500,
        flush_s=1.0,
        on_drop=None,
        spool: spoolmod.Spool | None = None,
        nice: int = 0,
    ):
        self.db = db
        self.capacity = capacity
        self.batch = batch
        self.spool = spool
        self.on_drop = on_drop or (lambda n: None)
        self._rows = collections.deque()  # rows the spool did not take
        self._dropped_in_episode = 0
        # Row ids: unique per process (a random prefix) and in it (a counter).
        self._prefix = secrets.token_hex(8)
        self._seq = itertools.count(1)
        self._spooled = 0  # rows this run put in the spool (the event loop counts)
        self._committed = 0  # ... of which are in the store (the writer counts)
        self.written = 0
        self.replayed = 0  # rows an earlier run left in the spool, written at start
        marks = ", ".join([db.param] * len(FIELDS))
        # Quoted: "user" is a reserved word in PostgreSQL.
        cols = ", ".join(f'"{f}"' for f in FIELDS)
        self._sql = (
            f"INSERT INTO {Usage._meta.table_name} ({cols}) VALUES ({marks}) "
            "ON CONFLICT (row_id) DO NOTHING"
        )
        self.worker = Worker(
            "usage_write", self._tick, flush_s, db=db, logger=_log, on_stop=self._last_tick,
            nice=nice,
        )  # fmt: skip

    def record(self, usage: UsageRow) -> None:
        """Keep one request's row. Called on the event loop."""
        row = usage.values(f"{self._prefix}{next(self._seq):x}")
        sp = self.spool
        if sp is not None and sp.append(row):
            self._spooled += 1
            return
        if len(self._rows) >= self.capacity:
            if self._dropped_in_episode == 0:
                _log.error("usage_buffer_full", capacity=self.capacity, action="dropping rows")
            self._dropped_in_episode += 1
            self.on_drop(1)
            return
        if self._dropped_in_episode:
            _log.warning("usage_rows_dropped", count=self._dropped_in_episode)
            self._dropped_in_episode = 0
        self._rows.append(row)

    def pending(self) -> int:
        """Rows of this run not yet in the store."""
        return self._spooled - self._committed + len(self._rows)

    # -- the writer's thread -------------------------------------------------------------

    def flush(self) -> int:
        """Write everything spooled or buffered now; return rows written. Raises if the
        store fails (what was not committed stays where it was, for the next try)."""
        total = 0
        sp = self.spool
        if sp is not None:
            sp.rotate()
            for segment in sp.closed():
                rows, bad = segment.load()
                self._insert(rows)
                n = len(rows)
                sp.remove(segment)
                total += n
                if segment in sp.leftover:
                    sp.leftover.remove(segment)
                    self.replayed += n
                    _log.info("usage_spool_replayed", segment=segment.path.name, rows=n,
                              skipped_lines=bad)  # fmt: skip
                else:
                    self._committed += n
        while self._rows:
            n = min(self.batch, len(self._rows))
            chunk = [self._rows.popleft() for _ in range(n)]
            try:
                self._insert(chunk)
            except Exception:
                self._rows.extendleft(reversed(chunk))  # keep them for the next try
                raise
            total += n
        return total

    def _insert(self, rows: list[tuple]) -> None:
        # A spool left by an older router holds rows without the newer fields (api:
        # m014, cached_tokens: m017), which are all nullable.
        width = len(FIELDS)
        rows = [r if len(r) == width else (*r, *(None,) * (width - len(r))) for r in rows]
        for i in range(0, len(rows), self.batch):
            part = rows[i : i + self.batch]
            with self.db.atomic():
                # Plain executemany: peewee's query builder cost more CPU than the
                # requests it was recording (seen in the router's profile).
                cursor = self.db.cursor()
                for j in range(0, len(part), SLICE_ROWS):
                    t = time.perf_counter()
                    cursor.executemany(self._sql, part[j : j + SLICE_ROWS])
                    # Rest as long as the slice took: on a busy core the event loop
                    # then waits for the writer a fraction of a millisecond at most.
                    time.sleep(time.perf_counter() - t)
            self.written += len(part)

    def _tick(self) -> None:
        self.flush()

    def _last_tick(self) -> None:
        try:
            self.flush()
        except Exception as e:
            _log.error("usage_write_failed_at_exit", reason=first_line(e))
        if self.spool is not None:
            self.spool.close()
            left = self.spool.closed()
            if left:
                _log.warning(
                    "usage_rows_left_in_spool",
                    segments=len(left),
                    dir=str(self.spool.dir),
                    action="written when a router starts on this spool",
                )
        if self._rows:
            _log.error("usage_rows_lost_at_exit", count=len(self._rows))

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Write what is spooled or buffered and stop the writer."""
        self.worker.stop(timeout=timeout)
