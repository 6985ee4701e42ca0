"""One background thread, run the same way everywhere: start, stop, tick, back off, and
log once when it starts failing and once when it recovers.

A worker that talks to the store keeps one connection for its whole life and opens a
new one only after an error. Wrapping every tick in a fresh connection cost an idle
router on PostgreSQL about ten new database sessions a second (213 in 20 s, counted
from `pg_stat_database.sessions`): each one a forked backend on the server.

`tick()` returns how long to wait before the next one (None: `interval_s`). It should
do no store work at all when it has nothing to do; the connection is opened lazily, on
its first query, so an idle worker costs the database nothing.

`nice` lowers the thread's CPU priority (Linux keeps a nice value per thread). The
router's usage writer runs at nice 10: at full load on one core it took its share of
the CPU in slices of a few milliseconds, during which no request moved (p99 at
concurrency 16 went from about 2.9 ms without it to 5-6 ms with it).
"""

import os
import random
import threading
from collections.abc import Callable

from llmgw import log

_log = log.get("llmgw.worker")


def first_line(e: BaseException, limit: int = 200) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:limit]


class Worker:
    """Calls `tick()` on its own thread every `interval_s` until stopped.

    `db` is a peewee database the tick uses, or None. peewee's connections are per
    thread, so the tick's queries use this thread's one connection; after a failed tick
    it is dropped, and the next query reconnects. Failures back off exponentially (with
    jitter) from `interval_s` up to `backoff_max_s`, and are logged as `<name>_failed`
    once and `<name>_recovered` once; `failed_fields` are said on the first (what the
    tool does meanwhile, say). `on_failure(e)` runs after each failed tick.
    """

    def __init__(
        self,
        name: str,
        tick: Callable[[], float | None],
        interval_s: float,
        *,
        db=None,
        logger: log.Logger | None = None,
        backoff_max_s: float = 30.0,
        on_failure: Callable[[BaseException], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        failed_fields: dict | None = None,
        nice: int = 0,
    ):
        self.name = name
        self.nice = nice
        self.tick = tick
        self.interval_s = interval_s
        self.db = db
        self.log = logger or _log
        self.backoff_max_s = max(backoff_max_s, interval_s)
        self.on_failure = on_failure
        self.on_stop = on_stop
        self.failed_fields = dict(failed_fields or {})
        self.failures = 0  # consecutive
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- asked from other threads ----------------------------------------------------------

    @property
    def failing(self) -> bool:
        return self.failures > 0

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Run the next tick now rather than after the wait."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the tick in progress; `on_stop` then runs on the worker's thread
        (with its connection), and the connection is closed."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # -- the thread ------------------------------------------------------------------------

    def run_once(self) -> float:
        """One tick with failure handling; returns the wait before the next."""
        try:
            wait = self.tick()
        except Exception as e:
            self.failures += 1
            if self.failures == 1:
                self.log.error(f"{self.name}_failed", reason=first_line(e), **self.failed_fields)
            self._drop_connection()
            if self.on_failure is not None:
                self.on_failure(e)
            backoff = min(self.backoff_max_s, self.interval_s * 2 ** (self.failures - 1))
            return backoff * random.uniform(0.8, 1.2)
        if self.failures:
            self.log.info(f"{self.name}_recovered", after_failures=self.failures)
            self.failures = 0
        return self.interval_s if wait is None else wait

    def _run(self) -> None:
        if self.nice:
            self._lower_priority()
        try:
            while not self._stop.is_set():
                wait = self.run_once()
                if self._stop.is_set():
                    break
                self._wake.wait(max(0.0, wait))
                self._wake.clear()
            if self.on_stop is not None:
                try:
                    self.on_stop()
                except Exception as e:
                    self.log.warning(f"{self.name}_stop_failed", reason=first_line(e))
        finally:
            self._close_connection()

    def _lower_priority(self) -> None:
        """Down to `nice`, never up (a process started under `nice 15` stays there)."""
        tid = threading.get_native_id()
        try:
            os.setpriority(
                os.PRIO_PROCESS, tid, max(self.nice, os.getpriority(os.PRIO_PROCESS, tid))
            )
        except OSError as e:  # the worker runs anyway, at the priority it has
            self.log.warning(f"{self.name}_nice_refused", nice=self.nice, reason=e.strerror)

    def _drop_connection(self) -> None:
        if self.db is None:
            return
        from llmgw.store import drop_connection  # the store imports peewee; keep this light

        drop_connection(self.db)

    def _close_connection(self) -> None:
        if self.db is None:
            return
        try:
            if not self.db.is_closed():
                self.db.close()
        except Exception:
            self._drop_connection()
