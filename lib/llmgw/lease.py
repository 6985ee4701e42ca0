"""The leader lease: which scheduler may place work, and the epoch that fences the rest.

One row in the store. Every statement computes time with the database's clock, so the
schedulers' clocks need not agree. A takeover raises the epoch by one, and it never
goes back: agents refuse commands from an older epoch, so a leader that hung and woke
after losing the lease cannot start or stop anything.

Why not advisory locks: a dropped connection frees them while the old leader still
believes it leads, and they give no token to fence with.

Timings (scheduler.lease_s / renew_s / step_down_s / standby_retry_s, 15/5/10/2 s):
the leader renews every 5 s and stops acting 10 s after its last successful renewal,
measured on its own monotonic clock from before it sent the renewal, so it has stopped
before the lease (15 s from the renewal, on the database's clock) can pass to another.
A standby tries every 2 s, so a dead leader is replaced within lease + retry, 17 s.
"""

import os
import secrets
import socket
from dataclasses import dataclass

import peewee

from llmgw.store import Lease, SchedulerSeen

LEASE_ID = 1


def holder_id(name: str) -> str:
    """This process, uniquely: name/host/pid/nonce (a restarted process is another holder)."""
    return f"{name}/{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


def _now_sql(db: peewee.Database) -> str:
    if isinstance(db, peewee.PostgresqlDatabase):
        return "extract(epoch from clock_timestamp())::float8"
    return "((julianday('now') - 2440587.5) * 86400.0)"


def db_now(db: peewee.Database) -> float:
    return float(db.execute_sql(f"SELECT {_now_sql(db)}").fetchone()[0])


@dataclass(frozen=True)
class Holder:
    holder: str
    name: str
    admin_url: str
    epoch: int
    expires_in: float  # seconds left on the database's clock; <= 0: expired


def current(db: peewee.Database) -> Holder | None:
    row = db.execute_sql(
        f"SELECT holder, name, admin_url, epoch, expires_at - {_now_sql(db)} "
        f"FROM {Lease._meta.table_name} WHERE id = {LEASE_ID}"
    ).fetchone()
    if row is None:
        return None
    return Holder(row[0], row[1], row[2], int(row[3]), float(row[4]))


def acquire(db: peewee.Database, holder: str, name: str, admin_url: str, lease_s: float,
            force: bool = False) -> int | None:  # fmt: skip
    """Take the lease if it is free or expired (or `force`); return the new epoch, else None.

    One statement, so two standbys cannot both take it: the row is locked by the first
    UPDATE and the second sees it unexpired.
    """
    p = db.param
    now, table = _now_sql(db), Lease._meta.table_name
    with db.atomic():
        db.execute_sql(
            f"INSERT INTO {table} (id, holder, name, admin_url, epoch, acquired_at, expires_at) "
            f"VALUES ({LEASE_ID}, '', '', '', 0, 0, 0) ON CONFLICT (id) DO NOTHING"
        )
        guard = "" if force else f" AND expires_at <= {now}"
        row = db.execute_sql(
            f"UPDATE {table} SET holder = {p}, name = {p}, admin_url = {p}, epoch = epoch + 1, "
            f"acquired_at = {now}, expires_at = {now} + {p} "
            f"WHERE id = {LEASE_ID}{guard} RETURNING epoch",
            (holder, name, admin_url, float(lease_s)),
        ).fetchone()
    return int(row[0]) if row else None


def renew(db: peewee.Database, holder: str, epoch: int, lease_s: float) -> bool:
    """Extend our lease; False if it is no longer ours (expired counts as lost)."""
    p = db.param
    now, table = _now_sql(db), Lease._meta.table_name
    with db.atomic():
        cur = db.execute_sql(
            f"UPDATE {table} SET expires_at = {now} + {p} "
            f"WHERE id = {LEASE_ID} AND holder = {p} AND epoch = {p} AND expires_at > {now}",
            (float(lease_s), holder, int(epoch)),
        )
        return cur.rowcount == 1


def release(db: peewee.Database, holder: str, epoch: int) -> bool:
    """Give the lease up at once (a clean stop), so a standby need not wait it out."""
    p = db.param
    now, table = _now_sql(db), Lease._meta.table_name
    with db.atomic():
        cur = db.execute_sql(
            f"UPDATE {table} SET expires_at = {now} "
            f"WHERE id = {LEASE_ID} AND holder = {p} AND epoch = {p}",
            (holder, int(epoch)),
        )
        return cur.rowcount == 1


def seen(db: peewee.Database, name: str, holder: str, role: str, admin_url: str) -> None:
    """Say who we are and what we do now, for `llmgw status`."""
    p = db.param
    now, table = _now_sql(db), SchedulerSeen._meta.table_name
    with db.atomic():
        db.execute_sql(
            f"INSERT INTO {table} (name, holder, role, admin_url, seen_at) "
            f"VALUES ({p}, {p}, {p}, {p}, {now}) ON CONFLICT (name) DO UPDATE SET "
            f"holder = excluded.holder, role = excluded.role, "
            f"admin_url = excluded.admin_url, seen_at = excluded.seen_at",
            (
                name,
                holder,
                role,
                admin_url,
            ),
        )


def schedulers(db: peewee.Database) -> list[dict]:
    """Every scheduler that has said what it does, and how long ago."""
    rows = db.execute_sql(
        f"SELECT name, role, admin_url, {_now_sql(db)} - seen_at "
        f"FROM {SchedulerSeen._meta.table_name} ORDER BY name"
    ).fetchall()
    return [
        {"name": r[0], "role": r[1], "admin_url": r[2], "seen_s_ago": round(float(r[3]), 1)}
        for r in rows
    ]


# A scheduler says what it does (`seen`) at every lease tick: renew_s apart while it
# leads, standby_retry_s while it stands by. One not seen for LATE_TICKS of its periods
# (and at least LATE_MIN_S: a busy machine delays a tick by a fraction of a second) has
# missed a tick: `llmgw status` calls it presumed down, even while its lease still runs.
LATE_TICKS = 1.5
LATE_MIN_S = 1.0


def holder_seen_s(db: peewee.Database, holder: str) -> float | None:
    """Seconds since the process `holder` last said what it does; None when no row has
    it (its name's row is another process's now: it restarted)."""
    p, table = db.param, SchedulerSeen._meta.table_name
    row = db.execute_sql(
        f"SELECT {_now_sql(db)} - seen_at FROM {table} WHERE holder = {p}", (holder,)
    ).fetchone()
    return None if row is None else float(row[0])


def late(seen_s: float | None, period_s: float) -> bool:
    """Whether a scheduler that ticks every `period_s` has missed a tick."""
    return seen_s is None or seen_s > max(LATE_TICKS * period_s, LATE_MIN_S)


def standing(held: Holder | None, seen_s: float | None, schedulers: list[dict],
             renew_s: float, standby_retry_s: float) -> dict:  # fmt: skip
    """What `llmgw status` says of the lease, from what the store says (pure):
    `leader`: the valid lease's holder, with `seen_s_ago` (None: it restarted since)
    and `presumed_down`; `expired`: the last holder once its lease ran out; and
    `successors`: the standbys seen lately, one of which takes the lease when it runs out."""
    successors = [s["name"] for s in schedulers
                  if s["role"] == "standby" and not late(s["seen_s_ago"], standby_retry_s)
                  and (held is None or s["name"] != held.name)]  # fmt: skip
    out: dict = {"leader": None, "successors": successors}
    if held is None or not held.name:
        return out
    if held.expires_in > 0:
        out["leader"] = {
            "name": held.name, "admin_url": held.admin_url, "epoch": held.epoch,
            "expires_in": round(held.expires_in, 1),
            "seen_s_ago": None if seen_s is None else round(max(0.0, seen_s), 1),
            "presumed_down": late(seen_s, renew_s),
        }  # fmt: skip
    else:
        out["expired"] = {"name": held.name, "epoch": held.epoch,
                          "expired_s_ago": round(-held.expires_in, 1)}  # fmt: skip
    return out
