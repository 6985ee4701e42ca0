"""A scheduler in the test's own process: its real `Scheduler` on a SQLite store, a
fake clock, and agents that are only the messages they would send.

A pass is `fleet.tick()`; what the scheduler would send is `fleet.sent()`. Nothing here
sleeps or opens a socket, so a behaviour that takes minutes of real time (five failed
starts, a node lost and back) runs in milliseconds.
"""

import json
import random
from pathlib import Path

from llmgw import bus, catalog, config
from llmgw.store import migrate, open_store
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.service import Scheduler

GiB = 1 << 30


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def model(name: str, memory: int = GiB, min_: int = 1, max_: int | None = None,
          gpus: int = 0, keep_alive_s: float = 300.0, scaling: dict | None = None,
          **extra) -> config.ModelConfig:  # fmt: skip
    return config.model_from(
        {
            "name": name,
            "source": f"/models/{name}.gguf",
            "profile": {"memory_bytes": memory, "gpus": gpus},
            "scaling": {
                "min": min_,
                "max": max_ if max_ is not None else max(min_, 1),
                "keep_alive_s": keep_alive_s,
                **(scaling or {}),
            },  # fmt: skip
            **extra,
        }
    )


class FakeLease:
    """The Leadership a scheduler sees: whether it leads is the fleet's `is_leading`."""

    db = None  # the admin API shows no lease

    def __init__(self, fleet: "Fleet"):
        self.fleet = fleet
        self.epoch = 0
        self.lost: list[str] = []  # why, each time the scheduler was told it is replaced

    def leading(self) -> bool:
        return self.fleet.is_leading

    def lose(self, why: str) -> None:
        self.lost.append(why)
        self.fleet.is_leading = False


class Fleet:
    """One scheduler and the agents it hears from."""

    def __init__(self, tmp: Path, models: list, leading: bool = True, **scheduler):
        self.db = open_store(f"sqlite://{tmp}/fleet.db")
        migrate(self.db)
        cfg = config.Config()
        cfg.scheduler.settle_s = 0.0
        cfg.scheduler.start_timeout_s = 60.0
        cfg.scheduler.node_lost_s = 10.0
        for key, value in scheduler.items():
            setattr(cfg.scheduler, key, value)
        self.cfg = cfg
        self.clock = Clock()
        checked = catalog.load(models)
        self.is_leading = leading
        self.lease = FakeLease(self)
        self.sched = Scheduler(cfg, checked, "secret", Needs(tmp / "weights"),
                               clock=self.clock, rng=random.Random(1), leadership=self.lease,
                               config_names={m.name for m in models})  # fmt: skip
        self.sched.load(list(models))
        self.shards: dict[str, dict[str, dict]] = {}  # node -> replica id -> shard

    # -- what agents say ---------------------------------------------------------------

    def heartbeat(self, node: str, memory: int = 8 * GiB, gpus: list | None = None,
                  kind: str = "heartbeat", disk_free: int = 0,
                  weights: list | None = None, engines: dict | None = None,
                  installable: dict | None = None,
                  topology: dict | None = None) -> None:  # fmt: skip
        """`topology`: the agent's Probe.report() (absent: a node with no nvidia-smi)."""
        if engines is None:
            engines = {"llama.cpp-0.3.36": {"state": "installed", "reason": ""}}
        body = {
            "resources": {
                "cpus": 4,
                "memory_total": 16 * GiB,
                "memory_available": memory,
                "gpus": gpus or [],
                "disk_total": 1000 * GiB if disk_free else 0,
                "disk_free": disk_free,
            },  # fmt: skip
            "engines": engines,
            **({"installable": installable} if installable is not None else {}),
            "shards": list(self.shards.get(node, {}).values()),
            "weights": weights or [],
            **({"topology": topology} if topology is not None else {}),
        }
        self._say(node, kind, body)

    def shard(self, node: str, rid: str, state: str, reason: str = "", **fields) -> None:
        """The agent on `node` reports replica `rid` in `state` (and keeps reporting it)."""
        r = self.sched.inv.replicas.get(rid)
        shard = {
            "id": rid, "model": r.model if r else fields.pop("model", ""), "state": state,
            "reason": reason, "endpoint": f"http://{node}:9000/{rid}", "rss": 0, **fields,
        }  # fmt: skip
        if state in ("failed", "stopped"):
            self.shards.get(node, {}).pop(rid, None)
        else:
            self.shards.setdefault(node, {})[rid] = shard
        self._say(node, "shard_status", {"node": node, "shard": shard})

    def activity(self, router: str, body: dict) -> None:
        """A router's activity report (idle times, load per replica, queue waits)."""
        self._say(router, "activity", body)

    def crash(self, node: str) -> None:
        """The node goes dark: its agent says nothing more, its engines are gone."""
        self.shards.pop(node, None)

    def _say(self, node: str, kind: str, body: dict) -> None:
        msg = json.loads(bus.encode(kind, node, body, 0))
        with self.sched.lock:
            self.sched.handle(node, msg)
        self.sched.write_behind()

    # -- what the scheduler does -------------------------------------------------------

    def tick(self, seconds: float = 0.0) -> None:
        self.clock.advance(seconds)
        with self.sched.lock:
            if self.is_leading:
                self.sched.tick()
            else:
                self.sched.standby_tick()
        self.sched.write_behind()

    def sent(self, kind: str | None = None) -> list[tuple[str, dict]]:
        """(node, body) of each message queued since the last call, of `kind` if given."""
        out = []
        for node, data in self.sched.outbox:
            msg = json.loads(data)
            if kind is None or msg["type"] == kind:
                out.append((node, msg["body"]))
        self.sched.outbox.clear()
        return out

    def start_ready(self, node: str) -> str:
        """Run a pass, expect one start on `node`, and report that replica ready."""
        self.tick()
        starts = [b for n, b in self.sent("start_shard") if n == node]
        assert len(starts) == 1, f"expected one start on {node}, got {starts}"
        rid = starts[0]["id"]
        self.shard(node, rid, "ready")
        return rid

    def close(self) -> None:
        self.db.close()
