"""LoRA adapters in this node's engines: `set_adapters` names every adapter a shard
should have loaded (tools/scheduler/adapters.py decides, least recently used out); the
agent fetches the new ones as it fetches weights (the mirror first), loads them into the
engine over its HTTP API with the engine key, unloads the ones no longer named, and
reports what is loaded in the shard's `adapters`.

The work runs on a thread per shard, one set at a time (a newer set waiting replaces an
older one): a fetch may take a while, and the bus loop must not wait on it.
"""

import threading
from pathlib import Path

import requests

from llmgw import engines, log
from llmgw_agentd.errors import AgentError
from llmgw_agentd.weights import entry_keys

_log = log.get("llmgw.agentd.adapters")

# Loading one takes ~0.02 s on CPU (vLLM 0.32); a fetch is not in this bound.
CALL_TIMEOUT_S = 30.0


class Loader:
    def __init__(self, supervisor, weights):
        self.supervisor = supervisor
        self.weights = weights
        self._lock = threading.Lock()
        self._next: dict[str, list[dict]] = {}  # shard -> the newest set not yet applied
        self._busy: set[str] = set()

    def set(self, body: dict) -> None:
        """Handle `set_adapters`: {"id": SHARD, "adapters": [{name, source, sha256,
        mirror?}, ...]}."""
        shard_id = str(body.get("id", ""))
        wanted = [a for a in body.get("adapters") or () if isinstance(a, dict) and a.get("name")]
        with self._lock:
            self._next[shard_id] = wanted
            if shard_id in self._busy:
                return  # the running thread takes it next
            self._busy.add(shard_id)
        threading.Thread(target=self._run, args=(shard_id,), name=f"adapters-{shard_id}",
                         daemon=True).start()  # fmt: skip

    def _run(self, shard_id: str) -> None:
        while True:
            with self._lock:
                wanted = self._next.pop(shard_id, None)
                if wanted is None:
                    self._busy.discard(shard_id)
                    return
            try:
                self._apply(shard_id, wanted)
            except Exception as e:  # a thread must not die silently; the scheduler resends
                _log.warning("adapters_not_set", shard=shard_id, reason=str(e)[:300])

    def _apply(self, shard_id: str, wanted: list[dict]) -> None:
        shard = self.supervisor.shards.get(shard_id)
        if shard is None or shard.done or shard.state != "ready":
            _log.info("adapters_ignored", shard=shard_id, reason="not a ready shard here")
            return
        ops = getattr(engines.of(shard.engine), "adapters", None)
        if ops is None:
            _log.warning("adapters_ignored", shard=shard_id,
                         reason=f"engine {shard.engine} loads no adapters")  # fmt: skip
            return
        key = self.supervisor.engine_key(shard_id)
        names = [str(a["name"]) for a in wanted]
        changed = False
        for name in [n for n in shard.adapters if n not in names]:  # room first
            try:
                self._post(shard, key, ops.unload_path, ops.unload_body(name), ops.already)
            except AgentError as e:  # no longer routed to it either way
                _log.warning("adapter_not_unloaded", shard=shard_id, adapter=name, reason=str(e))
            shard.adapters = [n for n in shard.adapters if n != name]
            changed = True
            _log.info("adapter_unloaded", shard=shard_id, adapter=name)
        for a in wanted:
            name = str(a["name"])
            if name in shard.adapters:
                continue
            try:
                path = self._fetch(shard, a)
                self._post(shard, key, ops.load_path, ops.load_body(name, str(path)), ops.already)
            except AgentError as e:
                _log.warning("adapter_not_loaded", shard=shard_id, adapter=name, reason=str(e))
                continue
            shard.adapters = [*shard.adapters, name]
            changed = True
            _log.info("adapter_loaded", shard=shard_id, adapter=name, path=str(path))
        if changed:
            self.supervisor.notify(shard.to_json())

    def _fetch(self, shard, a: dict) -> Path:
        source, sha256 = str(a.get("source", "")), str(a.get("sha256") or "")
        mirror = a.get("mirror")
        keys = entry_keys(source, sha256, mirror)
        with self.supervisor.lock:  # never evicted while the engine has it
            shard.weights = sorted({*shard.weights, *keys})
        return self.weights.fetch(source, sha256, mirror)

    @staticmethod
    def _post(shard, key: str, path: str, body: dict, already: tuple[str, ...]) -> None:
        try:
            r = requests.post(shard.endpoint + path, json=body, timeout=CALL_TIMEOUT_S,
                              headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        except requests.RequestException as e:
            raise AgentError(f"{path}: {e}") from None
        if r.status_code // 100 != 2 and not any(w in r.text for w in already):
            raise AgentError(f"{path}: {r.status_code} {r.text[:300]}")
