"""Usage rows, written in batches by a background thread.

The request path appends a tuple to a bounded buffer and moves on; it never waits
on the store. The writer drains the buffer every `flush_s` in batches of `batch`. If
the store is down, rows stay in the buffer and are written when it is back; only
when the buffer is full are new rows dropped, counted and logged. `stop()` flushes
what is left, so a SIGTERM loses nothing while the store is up.
"""

import collections
import threading

from llmgw import log
from llmgw.store import Usage

_log = log.get("llmgw.router.usage")

FIELDS = (
    "at", "request_id", "key_id", "model", "served_model", "endpoint",
    "prompt_tokens", "completion_tokens", "status", "latency_ms", "ttft_ms",
    "user", "project", "team", "org", "cost",
)  # fmt: skip


class UsageWriter:
    def __init__(self, db, capacity=100_000, batch=500, flush_s=1.0, on_drop=None):
        self.db = db
        self.capacity = capacity
        self.batch = batch
        self.flush_s = flush_s
        self.on_drop = on_drop or (lambda n: None)
        self._rows = collections.deque()
        self._dropped_in_episode = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.written = 0
        marks = ", ".join([db.param] * len(FIELDS))
        # Quoted: "user" is a reserved word in PostgreSQL.
        cols = ", ".join(f'"{f}"' for f in FIELDS)
        self._sql = f"INSERT INTO {Usage._meta.table_name} ({cols}) VALUES ({marks})"

    def record(self, row: tuple) -> None:
        """Queue one row (a tuple in FIELDS order). Called on the event loop."""
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
        return len(self._rows)

    def flush(self) -> int:
        """Write everything buffered now; return rows written. Raises if the store fails."""
        total = 0
        while self._rows:
            n = min(self.batch, len(self._rows))
            chunk = [self._rows.popleft() for _ in range(n)]
            try:
                with self.db.connection_context(), self.db.atomic():
                    # Plain executemany: peewee's query builder cost more CPU than the
                    # requests it was recording (seen in the router's profile).
                    self.db.cursor().executemany(self._sql, chunk)
            except Exception:
                self._rows.extendleft(reversed(chunk))  # keep them for the next try
                raise
            total += n
            self.written += n
        return total

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.flush_s)
            try:
                self.flush()
                if self._failing:
                    _log.info("usage_write_recovered", pending=self.pending())
                    self._failing = False
            except Exception as e:
                if not self._failing:
                    _log.error(
                        "usage_write_failed",
                        reason=str(e).strip().splitlines()[0],
                        pending=self.pending(),
                    )
                    self._failing = True
            if stopping:
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="usage", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Flush what is buffered and stop the writer."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=timeout)
        if self._rows:
            _log.error("usage_rows_lost_at_exit", count=len(self._rows))
