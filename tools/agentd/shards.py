"""A shard: one engine process this node runs for one replica, as the agent keeps it,
reports it (`to_json`, the bus's shard status) and writes it down to find its engine
again after a restart (`state_file`, `from_state_file`); and the environment its engine
runs in."""

import os
import subprocess
from collections import deque
from dataclasses import dataclass, field

from llmgw.states import ShardState

STARTING = ShardState.STARTING


@dataclass
class Shard:
    id: str
    model: str = ""
    profile: str = ""
    # The name of its model's profile (the scheduler's start_shard says; "": not said).
    profile_name: str = ""
    engine: str = ""
    state: str = STARTING
    reason: str = ""
    port: int = 0
    pid: int = 0
    started: int = 0  # process start time in ticks (process.create_time)
    started_at: float = 0.0
    endpoint: str = ""
    health: str = "/health"
    rss: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)
    stopping: bool = False
    done: bool = False
    lines: deque = field(default_factory=deque, repr=False)
    log_offset: int = 0
    weights: list = field(default_factory=list)  # cache entries it uses (never evicted)
    role: str = ""  # "rpc-worker": a part of a replica across nodes (workers.py)
    master: str = ""  # a gang's leader: the ADDR:PORT its workers join (workers.Rank)
    tokens: dict | None = None  # the engine's newest token counters (counters.py)
    adapters: list = field(default_factory=list)  # LoRA adapters loaded (adapters.py)
    # The UUIDs of the GPUs the scheduler assigned it: its engine's CUDA_VISIBLE_DEVICES.
    gpus: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "id": self.id, "model": self.model, "profile": self.profile, "state": self.state,
            "endpoint": self.endpoint, "port": self.port, "pid": self.pid, "rss": self.rss,
            "started_at": self.started_at, "reason": self.reason,
            **({"role": self.role} if self.role else {}),
            **({"master": self.master} if self.master else {}),
            **({"tokens": self.tokens} if self.tokens else {}),
            **({"adapters": list(self.adapters)} if self.adapters else {}),
            **({"gpus": list(self.gpus)} if self.gpus else {}),
            **({"profile_name": self.profile_name} if self.profile_name else {}),
        }  # fmt: skip

    def state_file(self) -> dict:
        return {
            "id": self.id, "model": self.model, "profile": self.profile, "engine": self.engine,
            "pid": self.pid, "create_time": self.started, "port": self.port,
            "endpoint": self.endpoint, "health": self.health, "started_at": self.started_at,
            "weights": self.weights, "role": self.role, "master": self.master,
            "gpus": self.gpus, "profile_name": self.profile_name,
        }  # fmt: skip

    @classmethod
    def from_state_file(cls, data: dict) -> "Shard":
        """The shard an earlier agent wrote (state_file); KeyError, ValueError or
        TypeError where the file lacks or garbles what finding its engine needs."""
        return cls(
            id=str(data["id"]), model=str(data.get("model", "")),
            profile=str(data.get("profile", "")), engine=str(data.get("engine", "")),
            pid=int(data["pid"]), started=int(data["create_time"]),
            port=int(data["port"]), endpoint=str(data["endpoint"]),
            health=str(data.get("health", "/health")),
            started_at=float(data.get("started_at", 0)),
            weights=[str(k) for k in data.get("weights", [])],
            role=str(data.get("role", "")), master=str(data.get("master") or ""),
            gpus=[str(g) for g in data.get("gpus") or []],
            profile_name=str(data.get("profile_name") or ""),
        )  # fmt: skip


def engine_env(extra: dict, gpus: list[str]) -> dict:
    """An engine's environment, whatever the engine: ours, its engine's additions, and
    with GPUs assigned, CUDA_VISIBLE_DEVICES naming them by UUID (never by index: the
    CUDA runtime may number cards otherwise than nvidia-smi does). Without it, two
    replicas on a node with several GPUs both loaded onto GPU 0."""
    env = {**os.environ, **extra}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env
