"""Which scheduler leads: the lease, kept by its own worker on the one store connection
it keeps (dropped and opened again only after an error).

The leader renews every renew_s. It may act only while `leading()`: until step_down_s
after the start of its last successful renewal, on its own monotonic clock. The loop
checks that before every pass and before sending any command, so a leader that was
stopped (SIGSTOP, a long GC, a hung disk) and wakes after its lease could have passed
on sends nothing: it steps down on the spot. A standby tries for the lease every
standby_retry_s; when it gets it, the scheduler takes over (see Scheduler.take_over).

With SQLite there is exactly one scheduler: a second one refuses to start while the
first lives. The epoch still rises on every start, so a hung old process is fenced out.
"""

import os
import socket
import threading
import time

import peewee

from llmgw import lease, log
from llmgw.errors import Error
from llmgw.worker import Worker
from llmgw_scheduler import metrics

_log = log.get("llmgw.scheduler.leadership")


class LeadershipError(Error):
    """This scheduler cannot run beside the one that holds the lease."""


def check_timings(cfg) -> None:
    s = cfg.scheduler
    if not 0 < s.renew_s < s.step_down_s < s.lease_s or s.standby_retry_s <= 0:
        raise LeadershipError(
            f"scheduler timings: need 0 < renew_s ({s.renew_s:g}) < step_down_s"
            f" ({s.step_down_s:g}) < lease_s ({s.lease_s:g}) and standby_retry_s > 0"
        )


def store_timeout(cfg) -> float:
    """How long this scheduler waits on the store: store.timeout_s, or step_down_s -
    renew_s if less. A renewal sent renew_s after the last one then fails by the time
    the leader must stop acting, rather than hanging for minutes on a store that
    stopped answering: the lease worker is free to stand by, and comes back as soon as
    the store answers. A standby's attempts are bounded alike, so it is ready to take
    over when the lease runs out."""
    s = cfg.scheduler
    return max(0.5, min(cfg.store.timeout_s, s.step_down_s - s.renew_s))


def _alive_here(holder: str) -> bool:
    """Whether a holder id (name/host/pid/nonce) names a live process on this host."""
    parts = holder.split("/")
    if len(parts) != 4 or parts[1] != socket.gethostname() or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def standby_news(followed: tuple[str, int] | None, held) -> tuple[str, int] | None:
    """The (leader, epoch) a standby should now say it follows, or None if unchanged
    (`held`: the lease as read, a lease.Holder or None)."""
    if held is None or held.expires_in <= 0 or not held.name:
        return None  # nobody leads: the next acquire takes it, and says `leading`
    now = (held.name, held.epoch)
    return None if now == followed else now


class Leadership:
    def __init__(self, db: peewee.Database, cfg, name: str, admin_url: str, on_change=None):
        self.db = db
        self.s = cfg.scheduler
        self.name = name
        self.admin_url = admin_url
        self.holder = lease.holder_id(name)
        self.sqlite = not isinstance(db, peewee.PostgresqlDatabase)
        self.epoch = 0  # ours while leading; the newest we took otherwise
        self._valid_until = 0.0  # monotonic
        self._lock = threading.Lock()
        # A store that fails is tried again every standby_retry_s (or renew_s, if less),
        # not backed off further: a leader must renew within step_down_s or stop acting,
        # and a standby must be ready to take over. Says lease_store_failed once.
        retry = min(self.s.renew_s, self.s.standby_retry_s)
        self.worker = Worker(
            "lease_store", self._tick, retry, db=db, logger=_log, backoff_max_s=retry,
            on_failure=self._store_failed, on_stop=self._release,
        )  # fmt: skip
        self._ticked_leading = False
        self._following: tuple[str, int] | None = None  # said in `standing_by`
        # Called (from this thread) with (epoch, True) on a takeover and (epoch, False)
        # when the lease is known lost.
        self.on_change = on_change or (lambda epoch, leading: None)
        self.renew_failures = 0

    # -- asked by the loop ---------------------------------------------------------------

    def leading(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            return self.epoch > 0 and now < self._valid_until

    def lose(self, why: str) -> None:
        """Step down now (an agent has seen a newer epoch, or the lease ran out).

        The log line can come late: a renewal stuck on a store that stopped answering
        is only seen to have failed when the call returns. The loop stopped acting when
        `leading()` turned false, so the line says how long ago that was
        (stopped_s_ago), which is what an operator lining up two schedulers' logs needs."""
        now = time.monotonic()
        with self._lock:
            was, until = self._valid_until > 0, self._valid_until
            self._valid_until = 0.0
        if was:
            _log.warning("stepped_down", epoch=self.epoch, reason=why,
                         stopped_s_ago=round(max(0.0, now - until), 3))  # fmt: skip
            self.on_change(self.epoch, False)

    # -- starting --------------------------------------------------------------------------

    def start_sqlite(self) -> None:
        """SQLite: take the lease now, with the epoch one higher, unless another live
        scheduler holds it."""
        held = lease.current(self.db)
        if held is not None and held.expires_in > 0 and held.holder and _alive_here(held.holder):
            pid = held.holder.split("/")[2]
            raise LeadershipError(
                f"another llmgw-scheduler ({held.name}, pid {pid}) is running on this SQLite"
                " store; SQLite allows one scheduler: use PostgreSQL for a standby"
            )
        t0 = time.monotonic()
        epoch = lease.acquire(self.db, self.holder, self.name, self.admin_url, self.s.lease_s,
                              force=True)  # fmt: skip
        self._took(epoch, t0)

    def start(self) -> None:
        if self.sqlite:
            self.start_sqlite()
        self.worker.start()

    def stop(self) -> None:
        """On a clean stop, give the lease up so a standby need not wait it out."""
        self.worker.stop()

    # -- the worker ------------------------------------------------------------------------

    def _took(self, epoch: int, t0: float) -> None:
        with self._lock:
            self.epoch = epoch
            self._valid_until = t0 + self.s.step_down_s
        _log.info("leading", name=self.name, epoch=epoch)
        metrics.EPOCH.set(epoch)
        self.on_change(epoch, True)

    def _tick(self) -> float:
        leading = self._ticked_leading = self.leading()
        t0 = time.monotonic()
        try:
            if leading:
                if lease.renew(self.db, self.holder, self.epoch, self.s.lease_s):
                    with self._lock:
                        self._valid_until = t0 + self.s.step_down_s
                else:
                    self.lose("the lease passed to another scheduler or ran out")
            else:
                if self._valid_until:  # ran out without a renewal: the loop has stopped
                    self.lose(f"no renewal for {self.s.step_down_s:g}s")
                epoch = lease.acquire(self.db, self.holder, self.name, self.admin_url,
                                      self.s.lease_s)  # fmt: skip
                if epoch is not None:
                    self._took(epoch, t0)
                    self._following = None
                else:
                    self._stand_by()
            lease.seen(self.db, self.name, self.holder,
                       "leader" if self.leading() else "standby", self.admin_url)  # fmt: skip
        finally:
            metrics.LEADER.labels(self.name).set(1 if self.leading() else 0)
        wait = self.s.renew_s if self.leading() else self.s.standby_retry_s
        return max(0.0, wait - (time.monotonic() - t0))

    def _stand_by(self) -> None:
        """Once when it starts standing by, and again when the leader it follows changes."""
        news = standby_news(self._following, lease.current(self.db))
        if news is not None:
            self._following = news
            _log.info("standing_by", name=self.name, leader=news[0], epoch=news[1])

    def _store_failed(self, e: BaseException) -> None:
        """A leader that cannot renew stops acting step_down_s after its last renewal, by
        `leading()`; the worker tries again on a fresh connection."""
        if self._ticked_leading:
            self.renew_failures += 1
            metrics.RENEW_FAILURES.inc()

    def _release(self) -> None:
        if self.leading():
            try:
                lease.release(self.db, self.holder, self.epoch)
                _log.info("lease_released", epoch=self.epoch)
            except peewee.PeeweeException as e:
                _log.warning("lease_release_failed", reason=str(e)[:200])
