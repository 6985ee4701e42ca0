"""The engines' own token counters, read from each serving shard's `/metrics` and sent
with the heartbeat, so the scheduler can check the routers' usage rows against them
(`llmgw usage reconcile`).

One reading per shard per heartbeat: `{"at", "prompt", "cached", "generated",
"process"}`, cumulative since the engine started. `prompt` is every prompt token the
engine took, those it reused from its cache included, whatever the engine: llama-server
counts the tokens it evaluated (`llamacpp:prompt_tokens_total`) apart from those it
reused (`llamacpp:prompt_tokens_cached_total`), and the two are added; vLLM counts them
all (`vllm:prompt_tokens_total`) and its cache hits apart (`vllm:prefix_cache_hits_total`).
`process` names the engine process (pid and start time): a new one means counters that
began again at 0. An engine with neither set of counters (a configured command without
them) sends none, and is left out of the check.

llama-server writes its counters with six significant digits (a C++ stream's default):
past a million tokens each reading is rounded, by at most half a unit of its sixth
digit. The scheduler says so beside the comparison.
"""

import time

import requests

from llmgw import log
from llmgw.worker import Worker

_log = log.get("llmgw.agentd.counters")

READ_TIMEOUT_S = 2.0

# Counter name -> what it counts; a set is used only when every name of it is there,
# except the cache hits (an older vLLM has none).
LLAMA = {
    "llamacpp:prompt_tokens_total": "evaluated",
    "llamacpp:prompt_tokens_cached_total": "cached",
    "llamacpp:tokens_predicted_total": "generated",
}
VLLM = {
    "vllm:prompt_tokens_total": "prompt",
    "vllm:generation_tokens_total": "generated",
    "vllm:prefix_cache_hits_total": "cached",
}


def _values(text: str, names: dict[str, str]) -> dict[str, float]:
    """Each named counter's value, summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if 0 <= brace < space or (brace >= 0 and space < 0):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[names[name]] = out.get(names[name], 0.0) + value
    return out


def parse(text: str) -> dict | None:
    """`{"prompt", "cached", "generated"}` from an engine's Prometheus text (cached None
    where it has no such counter); None for an engine with neither set of counters."""
    got = _values(text, LLAMA)
    if {"evaluated", "cached", "generated"} <= got.keys():
        return {
            "prompt": round(got["evaluated"] + got["cached"]),
            "cached": round(got["cached"]),
            "generated": round(got["generated"]),
        }
    got = _values(text, VLLM)
    if {"prompt", "generated"} <= got.keys():
        cached = got.get("cached")
        return {
            "prompt": round(got["prompt"]),
            "cached": round(cached) if cached is not None else None,
            "generated": round(got["generated"]),
        }
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
        tokens = parse(r.text) if r.status_code == 200 else None
        if tokens is None:
            return None
        return {"at": round(at, 3), **tokens, "process": f"{shard.pid}:{shard.started}"}

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
