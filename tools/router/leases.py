"""Leasing allowance from the store, off the request path.

A background worker keeps each counter that is in use topped up with enough allowance
for the next couple of seconds (at most a tenth of the limit, or one request if that is
more), leased with one atomic statement that grows the fleet's total only while it
stays within the limit; it gives back what it has not used once a counter has been idle
a few seconds. A request that finds its counter empty wakes the worker and waits for it
up to `router.lease_wait_s`. Concurrency slots are held per router with an expiry the
worker renews, so a router that dies frees its slots.

The worker keeps one store connection, and touches the store only while a counter is in
use or holds something: it used to open a fresh connection every 0.1 s tick, about ten
new PostgreSQL sessions a second from an idle router.

See docs/limits.md for the bounds this gives.
"""

import math
import secrets
import socket
import time

import peewee

from llmgw import log
from llmgw.store.tenancy import ConcurrencyHold, LimitWindow
from llmgw.worker import Worker
from llmgw_router import metrics
from llmgw_router.limits import Counter, Limiter

_log = log.get("llmgw.router.leases")

# A lease covers this many seconds of a counter's recent rate ...
HORIZON_S = 2.0
# ... but no more than this share of the limit, so idle leases strand little of it.
CAP_SHARE = 10
FLOOR_SHARE = 100
# Unused allowance goes back to the store after this long without a request.
IDLE_S = 5.0
# Concurrency holds last this long unless renewed every RENEW_S.
HOLD_TTL_S = 30.0
RENEW_S = 5.0
PRUNE_S = 600.0


# -- the statements ---------------------------------------------------------------------


def _least(db) -> str:
    return "LEAST" if isinstance(db, peewee.PostgresqlDatabase) else "MIN"


def lease(db, counter: str, window: int, ends_at: float, amount: int, limit: int):
    """Take up to `amount` of a counter's window for this router, in one statement that
    never lets the fleet's total pass `limit`. -> (granted, the fleet's total now)."""
    if amount <= 0:
        return 0, None
    t, p, least = LimitWindow._meta.table_name, db.param, _least(db)
    sql = (
        f'INSERT INTO {t} (counter, "window", leased, granted, ends_at) '
        f"VALUES ({p}, {p}, {least}({p}, {p}), {least}({p}, {p}), {p}) "
        f'ON CONFLICT (counter, "window") DO UPDATE SET '
        f"leased = {t}.leased + {least}({p}, {p} - {t}.leased), "
        f"granted = {least}({p}, {p} - {t}.leased) "
        f"WHERE {t}.leased < {p} RETURNING granted, leased"
    )
    args = (counter, window, amount, limit, amount, limit, ends_at, amount, limit, amount, limit,
            limit)  # fmt: skip
    with db.atomic():
        row = db.execute_sql(sql, args).fetchone()
        if row is not None:
            return int(row[0]), int(row[1])
        total = (
            LimitWindow.select(LimitWindow.leased)
            .where(LimitWindow.counter == counter, LimitWindow.window == window)
            .scalar()
        )
    return 0, int(total or 0)


def give_back(db, counter: str, window: int, amount: int) -> None:
    """Return allowance this router leased and did not use."""
    LimitWindow.update(leased=LimitWindow.leased - amount).where(
        LimitWindow.counter == counter,
        LimitWindow.window == window,
        LimitWindow.leased >= amount,
    ).execute()


def hold(db, counter: str, holder: str, want: int, limit: int, now: float, ttl: float):
    """Hold `want` concurrency slots of a counter (fewer if others hold the rest) until
    now + ttl. -> (held, the fleet's total). Grants on one counter are serialised by
    writing its lock row (holder "") first, on SQLite and PostgreSQL alike."""
    ch = ConcurrencyHold
    with db.atomic():
        ch.insert(counter=counter, holder="", slots=0, expires_at=0).on_conflict(
            conflict_target=[ch.counter, ch.holder], update={ch.slots: 0}
        ).execute()
        others = (
            ch.select(peewee.fn.COALESCE(peewee.fn.SUM(ch.slots), 0))
            .where(
                ch.counter == counter, ch.holder != "", ch.holder != holder, ch.expires_at > now
            )  # fmt: skip
            .scalar()
        )
        held = max(0, min(want, limit - int(others)))
        ch.insert(counter=counter, holder=holder, slots=held, expires_at=now + ttl).on_conflict(
            conflict_target=[ch.counter, ch.holder],
            update={ch.slots: held, ch.expires_at: now + ttl},
        ).execute()
    return held, int(others) + held


def renew(db, holder: str, now: float, ttl: float) -> None:
    ConcurrencyHold.update(expires_at=now + ttl).where(ConcurrencyHold.holder == holder).execute()


def prune(db, now: float) -> None:
    """Forget windows long over and holds long expired (any router may do it)."""
    LimitWindow.delete().where(LimitWindow.ends_at < now - 3600).execute()
    ConcurrencyHold.delete().where(
        ConcurrencyHold.expires_at < now - 3600, ConcurrencyHold.holder != ""
    ).execute()


# -- the thread -------------------------------------------------------------------------


class Leaser:
    def __init__(self, limiter: Limiter, db, tick_s: float = 0.1, clock=time.time):
        self.limiter = limiter
        self.db = db
        self.tick_s = tick_s
        self.clock = clock
        # Who holds concurrency slots: unique per process, so a restarted router never
        # renews its predecessor's holds.
        self.holder = f"{socket.gethostname()[:60]}-{secrets.token_hex(4)}"
        self.loop = None
        # One connection for the thread's life; a failed pass drops it and backs off (up
        # to a couple of seconds: a request that finds its counter empty wakes it anyway).
        self.worker = Worker(
            "lease",
            lambda: self.tick(self.clock()),
            tick_s,
            db=db,
            logger=_log,
            backoff_max_s=2.0,
            on_stop=self._give_back_all,
            failed_fields={"action": "admitting only what this router already holds"},
        )
        self._last_tick = clock()
        self._next_renew = 0.0
        self._next_prune = 0.0

    def wake(self) -> None:
        self.worker.wake()

    # -- one pass over the counters ---------------------------------------------------------

    def tick(self, now: float) -> None:
        """One pass; raises the first store error after tending every counter (the
        worker then drops the connection and backs off), having kept what we hold."""
        dt = max(1e-3, now - self._last_tick)
        self._last_tick = now
        counters = list(self.limiter.counters.values())
        if not counters:
            return  # no limits in use: nothing to lease, renew or prune, and no store work
        error = None
        for c in counters:
            try:
                self._tend(c, now, dt)
            except Exception as e:  # the store is down or slow: keep what we hold
                error = error or e
                self.limiter.failed(c)
                metrics.LEASE_FAILURES.inc()
            self._resolve(c)
        try:
            if now >= self._next_renew:
                self._renew(now)
            if now >= self._next_prune:
                prune(self.db, now)
                self._next_prune = now + PRUNE_S
        except Exception as e:
            error = error or e
            metrics.LEASE_FAILURES.inc()
        if error is not None:
            raise error

    def _tend(self, c: Counter, now: float, dt: float) -> None:
        lim = self.limiter
        with lim.lock:
            used, c.used = c.used, 0
            if used:
                c.last_used = now  # the request path counts use, and leaves this to us
            # A request found it short (need) or waits on it: lease for it now.
            waiting, need, c.need = bool(c.waiters) or c.need > 0, c.need, 0
            if c.period is not None:
                c.roll(now)
            local, in_use = c.local, c.in_use
        c.rate = 0.7 * c.rate + 0.3 * used / dt
        active = waiting or now - c.last_used < IDLE_S
        cap = max(1, c.limit // CAP_SHARE)
        # At least a hundredth of the limit: a busy counter with a large limit is then
        # leased a few times a minute, not every tick while its rate is measured.
        floor = max(1, c.limit // FLOOR_SHARE)
        target = max(need, min(cap, max(floor, math.ceil(c.rate * HORIZON_S)))) if active else 0
        if c.period is None:
            if not active and local <= 0 and in_use == 0:
                return
            want = in_use + max(target, 1 if active else 0)
            if waiting or local < target / 2 or (not active and local > 0):
                if not waiting and now < c.exhausted_until and want > in_use + local:
                    return
                held, fleet = hold(self.db, c.name, self.holder, want, c.limit, now, HOLD_TTL_S)
                lim.held(c, held, fleet, held < want, now, now + HOLD_TTL_S - 5.0)
            return
        if not active:
            if local > 0:
                amount, window = lim.take_back(c, now)
                if amount > 0:
                    try:
                        give_back(self.db, c.name, window, amount)
                    except Exception:
                        lim.put_back(c, window, amount)
                        raise
            return
        if waiting or (local < target / 2 and now >= c.exhausted_until):
            ask = max(1, target - local)
            granted, fleet = lease(self.db, c.name, c.window, c.ends, ask, c.limit)
            lim.granted(c, c.window, granted, fleet if fleet is not None else c.fleet,
                        granted < ask, now)  # fmt: skip

    def _renew(self, now: float) -> None:
        concurrent = [
            c for c in self.limiter.counters.values() if c.period is None and c.local + c.in_use
        ]
        if concurrent:
            renew(self.db, self.holder, now, HOLD_TTL_S)
            with self.limiter.lock:
                for c in concurrent:
                    c.valid_until = now + HOLD_TTL_S - 5.0
        self._next_renew = now + RENEW_S

    def _resolve(self, c: Counter) -> None:
        if not c.waiters:
            return
        waiters = self.limiter.take_waiters(c)
        if self.loop is not None and waiters:
            self.loop.call_soon_threadsafe(_wake_all, waiters)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, loop) -> None:
        self.loop = loop
        self.worker.start()

    def stop(self) -> None:
        """Stop, and give back what this router holds (best effort: a router that
        cannot reach the store leaves it to the window's end, or the hold's expiry)."""
        started = self.worker._thread is not None
        self.worker.stop()
        if not started:
            self._give_back_all()  # never ran: nothing else will

    def _give_back_all(self) -> None:
        now = self.clock()
        try:
            concurrent = False
            for c in list(self.limiter.counters.values()):
                if c.period is None:
                    concurrent = True
                    continue
                amount, window = self.limiter.take_back(c, now)
                if amount > 0:
                    give_back(self.db, c.name, window, amount)
            if concurrent:
                ConcurrencyHold.delete().where(ConcurrencyHold.holder == self.holder).execute()
        except Exception as e:
            _log.warning("leases_not_returned", reason=str(e).strip().splitlines()[0][:200])


def _wake_all(waiters: list) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)
