"""kill -9 of a router under load loses no usage row: the spool keeps them, and the next
start on the same store and spool writes each exactly once."""

import collections
import json
import signal
import threading

import requests

from tests.helpers import eventually

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
CLIENTS = 8


class Load:
    """Clients sending mixed streamed and whole chat completions until told to stop;
    `complete` holds the x-request-id of every answer a client received in full."""

    def __init__(self, url: str, secret: str):
        self.url, self.secret = url, secret
        self.complete: set[str] = set()
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self, i: int) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {self.secret}"}
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (i + n) % 2 == 0
            try:
                resp = session.post(
                    self.url + "/v1/chat/completions",
                    data=json.dumps({**CHAT, "stream": stream}),
                    headers=headers,
                    stream=stream,
                    timeout=10,
                )
                if resp.status_code != 200:
                    ok = False
                elif stream:
                    ok = any(line == b"data: [DONE]" for line in resp.iter_lines())
                else:
                    ok = bool(resp.json()["choices"])
            except (requests.RequestException, ValueError):
                ok = False
                session = requests.Session()  # the router is gone: a fresh connection
            with self._lock:
                if ok:
                    self.complete.add(resp.headers["x-request-id"])
                else:
                    self.failed += 1


def rows_by_status(store_url: str) -> dict[int, collections.Counter]:
    from llmgw.store import Usage, open_store

    db = open_store(store_url)
    try:
        out = collections.defaultdict(collections.Counter)
        for r in Usage.select(Usage.request_id, Usage.status):
            out[r.status][r.request_id] += 1
        return out
    finally:
        db.close()


def spooled_lines(directory) -> int:
    return sum(p.read_bytes().count(b"\n") for p in directory.glob("usage-*.spool"))


def test_a_router_killed_under_load_loses_no_usage_row_and_doubles_none(
    store_url, make_router, engine, tmp_path
):
    spool = tmp_path / "spool"
    # Stream chunks a little apart, so requests of both kinds are in flight at the kill;
    # segments are committed five times a second, so some are committed and not yet
    # removed when the router dies.
    engine.control(delay_s=0.002, chunks=5)
    settings = {"usage_spool_dir": str(spool), "usage_flush_s": 0.2}
    router = make_router([engine.url], **settings)
    with Load(router.url, router.secret) as load:
        eventually(lambda: len(load.complete) >= 400, timeout=60, what="400 complete answers")
        router.proc.p.send_signal(signal.SIGKILL)
        router.proc.p.wait(timeout=10)
    assert spooled_lines(spool) > 0  # the kill left rows that only the spool holds

    # Started again, as systemd would, on the same store and spool.
    make_router([engine.url], **settings)
    eventually(lambda: spooled_lines(spool) == 0, timeout=30, what="the spool to be replayed")
    ok = rows_by_status(store_url)[200]
    missing = load.complete - set(ok)
    twice = sorted(rid for rid, n in ok.items() if n > 1)
    assert not missing, f"{len(missing)} of {len(load.complete)} complete answers have no row"
    assert not twice, f"{len(twice)} requests have more than one row"
    # A row may say 200 for an answer whose last bytes the kill stopped: at most the
    # requests in flight then.
    assert len(set(ok) - load.complete) <= CLIENTS
