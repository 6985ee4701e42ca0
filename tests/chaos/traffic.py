"""Steady mixed traffic through two routers, failing over as a load balancer would.

Each worker thread sends one request at a time, streaming and non-streaming in turn, to
the routers in turn. A connection error before anything of the answer arrived (refused,
reset, closed before the status line or the first streamed token) is retried once on the
other router with the same request id, which is how the usage rows are matched to what
the client saw. As a load balancer's health check would, a connection error also takes
that router out of the rotation until its /ready says ok again; with `probe_s`, a thread
also asks every router's /ready that often and only those that said ok recently get
requests (a router that is up but not ready, or that hangs, is left out before a request
finds out). Every request ends in one of three outcomes:

    ok      a complete 200 answer (a JSON body with choices; a stream that reached [DONE])
    cut     a stream that had started (a token arrived), then broke: the one failure
            a crash may cause, since the tokens already sent cannot be taken back
    failed  anything else: an error status, an error before the first token, no router
"""

import json
import threading
import time
from dataclasses import dataclass, field

import requests

OK, CUT, FAILED = "ok", "cut", "failed"


@dataclass
class Sent:
    """One client request and what became of it."""

    rid: str
    phase: str
    stream: bool
    routers: list[int] = field(default_factory=list)  # indexes of the routers tried
    took_s: float = 0.0
    outcome: str = FAILED
    detail: str = ""


class _Broke(Exception):
    """The connection failed; `started`: after a streamed token had arrived."""

    def __init__(self, reason: str, started: bool):
        super().__init__(reason)
        self.started = started


class Traffic:
    """`workers` threads of requests for `model` through `urls` until stopped."""

    def __init__(self, urls: list[str], secret: str, model: str, workers: int = 4,
                 pause_s: float = 0.02, timeout_s: float = 20.0, tag: str = "chaos",
                 probe_s: float | None = None):  # fmt: skip
        self.urls, self.secret, self.model = urls, secret, model
        self.pause_s, self.timeout_s, self.tag, self.probe_s = pause_s, timeout_s, tag, probe_s
        self.phase = "start"
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._n = 0
        self._down: dict[int, float] = {}  # router index -> when /ready was last asked
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]
        if probe_s is not None:
            self._ready = {i: self._probe(i) for i in range(len(urls))}
            self._threads.append(threading.Thread(target=self._prober, daemon=True))
        for t in self._threads:
            t.start()

    # -- looking ---------------------------------------------------------------------------

    def of(self, phase: str) -> list[Sent]:
        with self._lock:
            return [s for s in self.sent if s.phase == phase]

    def answered(self, phase: str, router: int | None = None) -> int:
        """Complete answers in `phase` (through `router` last, if given)."""
        return sum(
            1
            for s in self.of(phase)
            if s.outcome == OK and (router is None or s.routers[-1] == router)
        )

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    # -- sending ---------------------------------------------------------------------------

    def _run(self, worker: int) -> None:
        sessions = [requests.Session() for _ in self.urls]
        stream, turn = worker % 2 == 1, worker
        while not self._stop.is_set():
            with self._lock:
                self._n += 1
                sent = Sent(f"{self.tag}-{self.phase}-{self._n}", self.phase, stream)
                self.sent.append(sent)
            t0 = time.monotonic()
            for i in self._rotation(turn):
                sent.routers.append(i)
                try:
                    sent.outcome, sent.detail = self._one(sessions[i], self.urls[i], sent)
                    break
                except _Broke as e:
                    sent.outcome, sent.detail = (CUT if e.started else FAILED), str(e)
                    with self._lock:
                        self._down.setdefault(i, 0.0)
                        if self.probe_s is not None:
                            self._ready[i] = False  # until its /ready says ok again
                    sessions[i].close()
                    sessions[i] = requests.Session()  # a load balancer's fresh connection
                    if e.started:
                        break  # tokens reached the client: nobody may retry it
            sent.took_s = time.monotonic() - t0
            stream, turn = not stream, turn + 1
            self._stop.wait(self.pause_s)

    def _rotation(self, turn: int) -> list[int]:
        """The routers to try, in turn order, leaving out those taken out of the rotation
        until their /ready says ok (asked at most every 0.2 s, as a load balancer does)."""
        n = len(self.urls)
        order = [(turn + k) % n for k in range(n)]
        if self.probe_s is not None:
            with self._lock:
                up = [i for i in order if self._ready[i]]
            return up or order
        with self._lock:
            down = dict(self._down)
        for i, asked in list(down.items()):
            if time.monotonic() - asked < 0.2:
                continue
            with self._lock:
                self._down[i] = time.monotonic()
            try:
                healthy = requests.get(f"{self.urls[i]}/ready", timeout=1).status_code == 200
            except requests.RequestException:
                healthy = False
            if healthy:
                with self._lock:
                    self._down.pop(i, None)
                del down[i]
        up = [i for i in order if i not in down]
        return up or order  # with none up, try them all anyway

    def _probe(self, i: int) -> bool:
        try:
            return requests.get(f"{self.urls[i]}/ready", timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def _prober(self) -> None:
        while not self._stop.wait(self.probe_s):
            for i in range(len(self.urls)):
                ok = self._probe(i)
                with self._lock:
                    self._ready[i] = ok

    def _one(self, session: requests.Session, url: str, sent: Sent) -> tuple[str, str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}]}
        if sent.stream:
            body["stream"] = True
        try:
            r = session.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.secret}", "x-request-id": sent.rid},
                timeout=(3.0, self.timeout_s),
                stream=sent.stream,
            )
        except requests.ReadTimeout as e:
            return FAILED, f"{type(e).__name__}: {e}"[:200]
        except requests.RequestException as e:  # refused, reset, closed mid-body
            raise _Broke(f"connection: {type(e).__name__}", started=False) from None
        if r.status_code != 200:
            return FAILED, f"HTTP {r.status_code} {r.text[:200]}"
        if not sent.stream:
            try:
                if r.json()["choices"]:
                    return OK, ""
            except (ValueError, KeyError, TypeError):
                pass
            return FAILED, f"a 200 without choices: {r.text[:200]}"
        return self._read_stream(r)

    def _read_stream(self, r: requests.Response) -> tuple[str, str]:
        started = False
        try:
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue  # blank separators and ": keepalive" comments
                data = line[6:]
                if data == b"[DONE]":
                    return OK, ""
                event = json.loads(data)
                if "error" in event:
                    message = event["error"].get("message", "")[:200]
                    return (CUT if started else FAILED), f"error event: {message}"
                if event.get("choices"):
                    started = True
        except (requests.RequestException, ValueError) as e:
            raise _Broke(f"stream: {type(e).__name__}", started=started) from None
        finally:
            r.close()
        raise _Broke("stream ended without [DONE]", started=started)
