"""Draining a ready engine before it is stopped, as its engine's definition says.

The scheduler took the replica out of the routing table when it asked for the stop, so
nothing new arrives once routers have the new table (`Drain.settle_s`). Then the
engine's load signal (llama-server's /slots, vLLM's /metrics: llmgw.engines) is read
every `Drain.poll_s` until nothing runs or waits there, or agent.drain_timeout_s has
passed; only then is it sent SIGTERM. A draining vLLM used to get the settle time and
SIGTERM, cutting the requests it was answering: it had no /slots to ask.

An engine whose signal cannot be read at the first try gets the settle time only; one
that answered before and fails to now (busy, or slow to answer) is asked again until
the grace period ends.
"""

import time
from collections.abc import Callable

import requests

from llmgw import engines, log

_log = log.get("llmgw.agentd.drain")

READ_TIMEOUT_S = 2.0


def http_get(endpoint: str, key: str) -> Callable[[str], tuple[int, bytes]]:
    """GET endpoint+path with the engine key: (status, body); OSError when unreachable."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(path: str) -> tuple[int, bytes]:
        try:
            r = requests.get(endpoint + path, headers=headers, timeout=READ_TIMEOUT_S)
        except requests.RequestException as e:
            raise OSError(str(e)) from None
        return r.status_code, r.content

    return get


def read(sources: list[engines.Engine], get) -> tuple[engines.Load | None, list]:
    """The first load signal one of `sources` reads, and the sources to ask next time
    (the one that answered first)."""
    for engine in sources:
        try:
            status, body = get(engine.load_path)
        except OSError:
            return None, sources
        load = engines.read_load(engine, status, body)
        if load is not None:
            return load, [engine, *(e for e in sources if e is not engine)]
    return None, sources


def drain(shard_id: str, engine: str | None, endpoint: str, key: str, grace_s: float,
          get=None, clock=time.monotonic, sleep=time.sleep) -> bool:  # fmt: skip
    """Wait, at most `grace_s`, until the engine (a registered engine's name, or None
    for one that is not) says nothing runs; True when it did, False when the grace
    period ended first or it cannot say."""
    get = get or http_get(endpoint, key)
    sources = engines.signal_sources(engine)
    found = engines.get(engine) if engine else None
    policy = found.drain if found is not None else engines.Drain()
    deadline = clock() + max(0.0, grace_s)
    sleep(min(policy.settle_s, max(0.0, deadline - clock())))
    answered = False
    while clock() < deadline:
        load, sources = read(sources, get)
        if load is None and not answered:
            _log.info("drain_unread", shard=shard_id, action="settle time only")
            return False
        if load is not None:
            answered = True
            if load.idle:
                return True
        sleep(policy.poll_s)
    _log.warning("drain_timed_out", shard=shard_id, after_s=grace_s)
    return False
