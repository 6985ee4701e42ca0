"""The engines' own token counters, read from each serving shard's `/metrics` and sent
with the heartbeat, so the scheduler can check the routers' usage rows against them
(`llmgw usage reconcile`).

One reading per shard per heartbeat: `{"at", "prompt", "cached", "generated",
"process"}`, cumulative since the engine started. `prompt` is every prompt token the
engine took, those it reused from its cache included, whatever the engine; which
counters say so is each engine's (llmgw.engines: llama-server counts the tokens it
evaluated apart from those it reused, and the two are added; vLLM counts them all and
its cache hits apart).
`process` names the engine process (pid and start time): a new one means counters that
began again at 0. An engine with neither set of counters (a configured command without
them) sends none, and is left out of the check.

llama-server writes its counters with six significant digits (a C++ stream's default):
past a million tokens each reading is rounded, by at most half a unit of its sixth
digit. The scheduler says so beside the comparison.
"""

import time

import requests

from llmgw import engines, log
from llmgw.worker import Worker

_log = log.get("llmgw.agentd.counters")

READ_TIMEOUT_S = 2.0


def parse(text: str, engine: str | None = None) -> dict | None:
    """`{"prompt", "cached", "generated"}` from an engine's Prometheus text (cached None
    where it has no such counter), by the counters its engine names
    (llmgw.engines.TokenCounters), or for an engine not registered by the first
    registered engine's whose counters are all there; None where none are."""
    found = engines.get(engine) if engine else None
    for candidate in [found] if found is not None else [engines.get(n) for n in engines.names()]:
        tokens = engines.read_tokens(candidate, text)
        if tokens is not None:
            return tokens
    return None


class Counters:
    """Reads every serving shard's counters every `interval_s` on a thread of its own
    (an engine slow to answer must not hold up the bus loop), and keeps the newest
    reading on the shard, where the heartbeat finds it."""

    def __init__(self, supervisor, interval_s: float, clock=time.time):
        self.supervisor = supervisor
        self.clock = clock
        self.session = requests.Session()
        self.worker = Worker("engine_counters", self.tick, interval_s, logger=_log)

    def tick(self) -> None:
        for shard, key in self.supervisor.serving():
            self.supervisor.set_tokens(shard.id, self.read(shard, key))

    def read(self, shard, key: str) -> dict | None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = self.session.get(
                shard.endpoint + "/metrics", headers=headers, timeout=READ_TIMEOUT_S
            )
        except requests.RequestException as e:
            _log.debug("counters_unread", shard=shard.id, reason=str(e)[:200])
            return None
        at = self.clock()
        engine = engines.of(shard.engine)
        tokens = parse(r.text, engine.name if engine else None) if r.status_code == 200 else None
        if tokens is None:
            return None
        return {"at": round(at, 3), **tokens, "process": f"{shard.pid}:{shard.started}"}

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
