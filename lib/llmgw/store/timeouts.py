"""How long a tool waits on PostgreSQL, so a store that stops answering fails a call
instead of hanging the thread that made it.

A partition that drops packets (not a refused connection) held a connect for the SYN
retries (about 2 minutes) and a query on an open connection for TCP's retransmissions
(about 15): a scheduler stuck in one could neither renew its lease, stand by, nor come
back once the partition healed. Everything below comes from one number, T (`[store]
timeout_s`; a scheduler uses less, see leadership.store_timeout):

- libpq's own, for every tool: connect_timeout, TCP keepalives (an idle connection to a
  host that is gone is found dead in about T) and tcp_user_timeout (data sent and not
  acknowledged for T ends the connection). They work where the kernel sees packets lost.
- `bounded` (the daemons): psycopg2 calls `wait()` for every round trip, connecting
  included, and it gives up after T without an answer. This also catches what the kernel
  cannot see: a server that acknowledges and never answers (a frozen host, a hung disk,
  a proxy that stopped forwarding).
- the server's side (the daemons): statement_timeout = T, so a slow statement ends
  cleanly there rather than running on after the client gave up; and
  idle_in_transaction_session_timeout = T, so a client cut off inside a transaction does
  not keep its row locks (the lease's row) until the server's keepalive, 2 hours later.

`patient()` lifts the bound and the statement timeout on the calling thread for work
that is long by nature: migrations, usage reports, the rollup.
"""

import functools
import math
import os
import select
import socket
import threading
import time
from contextlib import contextmanager

DEFAULT_S = 10.0

_local = threading.local()


def libpq_params(timeout_s: float) -> dict:
    """Connection parameters that bound connecting and find a dead peer in about T."""
    t = max(1.0, float(timeout_s))
    return {
        "connect_timeout": max(2, math.ceil(t)),  # libpq takes whole seconds, 2 at least
        "keepalives": 1,
        "keepalives_idle": max(1, int(t / 2)),
        "keepalives_interval": max(1, int(t / 6)),
        "keepalives_count": 3,
        "tcp_user_timeout": int(t * 1000),
    }


def server_options(timeout_s: float) -> str:
    """libpq's `options`: the session's limits on the server's side."""
    ms = int(max(1.0, float(timeout_s)) * 1000)
    return f"-c statement_timeout={ms} -c idle_in_transaction_session_timeout={ms}"


@functools.cache
def connection_class(wait_s: float):
    """A psycopg2 connection class whose round trips `wait()` bounds by `wait_s`."""
    import psycopg2.extensions

    install()
    return type("BoundedConnection", (psycopg2.extensions.connection,), {"wait_s": wait_s})


def install() -> None:
    """Make psycopg2 wait through `wait()` (for every connection in this process: one
    without a `wait_s` waits as long as it takes, as without it)."""
    import psycopg2.extensions

    if psycopg2.extensions.get_wait_callback() is not wait:
        psycopg2.extensions.set_wait_callback(wait)


def wait(conn) -> None:
    """psycopg2's wait callback: poll the connection until its round trip is done, for at
    most the connection's `wait_s` (unless this thread is `patient()`). At the deadline
    the socket is shut down, so the connection is as dead as one the server closed, and
    the call fails with OperationalError."""
    import psycopg2
    import psycopg2.extensions as ext

    limit = None if getattr(_local, "patient", 0) else getattr(conn, "wait_s", None)
    deadline = None if limit is None else time.monotonic() + limit
    fd = conn.fileno()
    poller = select.poll()
    while True:
        state = conn.poll()
        if state == ext.POLL_OK:
            return
        if state not in (ext.POLL_READ, ext.POLL_WRITE):
            raise psycopg2.OperationalError(f"bad state from poll: {state}")
        poller.register(fd, select.POLLIN if state == ext.POLL_READ else select.POLLOUT)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not poller.poll(None if left is None else left * 1000) and left is not None:
            if time.monotonic() >= deadline:
                _cut(fd)
                raise psycopg2.OperationalError(
                    f"the store did not answer within {limit:g}s (store.timeout_s)"
                )


def _cut(fd: int) -> None:
    """Shut the connection's socket down: its next use fails at once."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


@contextmanager
def patient(db=None):
    """On this thread: no bound on waiting, and (on `db`'s connection, if PostgreSQL) no
    statement timeout, for work that is long by nature."""
    import peewee

    pg = isinstance(db, peewee.PostgresqlDatabase)
    _local.patient = getattr(_local, "patient", 0) + 1
    try:
        if pg:
            db.execute_sql("SET statement_timeout = 0")
        yield
    finally:
        _local.patient -= 1
        if pg:
            try:
                db.execute_sql("RESET statement_timeout")
            except Exception:  # the connection failed meanwhile: the next one starts afresh
                pass
