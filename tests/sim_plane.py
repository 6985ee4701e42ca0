"""The real llmgw-scheduler with simulated agents and routers (tests/sim_fleet.py): its
config, its store with every peer's key registered, the process, and how to ask it.

    plane = Plane(tmp, agents=1000, routers=20)
    plane.start()          # the store, keys, the scheduler process
    plane.start_peers()    # child processes playing the agents and routers
    ...
    plane.stop()
"""

import json
import resource
import sys
import time
from pathlib import Path

import requests

from llmgw import bus
from tests.helpers import BIN, Proc, free_port, llmgw
from tests.sim_fleet import ENGINE, GiB, Sim, keypairs, register

MODEL_MEMORY = 4 * GiB
REPLICAS_PER_MODEL = 2


def model_name(i: int) -> str:
    return f"model-{i:05d}"


class Plane:
    def __init__(self, tmp: Path, agents: int, routers: int, store_url: str = "",
                 heartbeat_s: float = 2.0, scheduler: str = "", agent_processes: int = 4,
                 models: int | None = None, open_files: int = 0):  # fmt: skip
        """`scheduler`: more [scheduler] lines (timings); `models`: how many, each with
        two replicas (default: one per agent, so about 2 x agents replicas);
        `open_files`: start the scheduler with this soft limit on open files (0: ours),
        as systemd's default of 1024 would."""
        self.tmp = tmp
        self.etc = tmp / "etc"
        self.curve = self.etc / "pki" / "curve"
        self.curve.mkdir(parents=True, exist_ok=True)
        self.store_url = store_url or f"sqlite://{tmp}/llmgw.db"
        self.n_agents, self.n_routers = agents, routers
        self.n_models = agents if models is None else models
        self.heartbeat_s = heartbeat_s
        self.agent_processes = agent_processes
        self.scheduler_extra = scheduler
        self.open_files = open_files
        self.ports = {"bus": free_port(), "pub": free_port(), "metrics": free_port(),
                      "admin": free_port()}  # fmt: skip
        self.bus = f"tcp://127.0.0.1:{self.ports['bus']}"
        self.pub = f"tcp://127.0.0.1:{self.ports['pub']}"
        self.admin_url = f"http://127.0.0.1:{self.ports['admin']}"
        self.proc: Proc | None = None
        self.sim: Sim | None = None
        self.agent_names = [f"sim-{i:05d}" for i in range(agents)]
        self.router_names = [f"simrouter-{i:03d}" for i in range(routers)]

    # -- config ------------------------------------------------------------------------

    def _models(self) -> str:
        weights = self.tmp / "weights.gguf"
        weights.write_bytes(b"not really a model")
        out = []
        for i in range(self.n_models):
            gpus = "gpus = 1\n" if i % 8 == 7 else ""  # some models want a GPU each
            out.append(
                f'[[models]]\nname = "{model_name(i)}"\nsource = "{weights}"\n'
                f'engine = "{ENGINE}"\nengine_version = "1"\n'
                f"[models.profile]\nmemory_bytes = {MODEL_MEMORY}\n{gpus}"
                f"[models.scaling]\nmin = {REPLICAS_PER_MODEL}\nmax = {REPLICAS_PER_MODEL}\n"
            )
        return "".join(out)

    def config(self) -> Path:
        engine = json.dumps([sys.executable, "-c", "pass"])
        cfg = self.tmp / "scheduler.toml"
        cfg.write_text(
            f'[paths]\nconfig_dir = "{self.etc}"\nstate_dir = "{self.tmp / "state"}"\n'
            '[log]\nlevel = "info"\n'
            f'[scheduler]\nbus = "{self.bus}"\npublish = "{self.pub}"\n'
            f'metrics_listen = "127.0.0.1:{self.ports["metrics"]}"\n'
            f'admin_listen = "127.0.0.1:{self.ports["admin"]}"\n'
            + self.scheduler_extra
            + f'[[agent.engines]]\nname = "{ENGINE}"\nversion = "1"\ncommand = {engine}\n'
            + self._models()
        )
        return cfg

    # -- processes ---------------------------------------------------------------------

    def start(self) -> None:
        """Register every peer's key, then start the scheduler."""
        self.server_public = bus.create_keypair(self.curve, bus.SCHEDULER)
        self.agent_keys = keypairs(self.n_agents)
        self.router_keys = keypairs(self.n_routers)
        agents = zip(self.agent_names, self.agent_keys, strict=True)
        routers = zip(self.router_names, self.router_keys, strict=True)
        register(self.store_url, [(n, "agent", k[0]) for n, k in agents]
                 + [(n, "router", k[0]) for n, k in routers])  # fmt: skip
        argv = [str(BIN / "llmgw-scheduler"), "--config", str(self.config())]
        if self.open_files:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            argv = ["prlimit", f"--nofile={self.open_files}:{hard}", "--", *argv]
        self.proc = Proc(argv,
                         self.tmp / "scheduler.log", env={"LLMGW_STORE": self.store_url},
                         health=f"http://127.0.0.1:{self.ports['metrics']}/metrics")  # fmt: skip
        self.proc.wait_healthy(60)

    def start_peers(self) -> None:
        self.sim = Sim(self.bus, self.pub, self.server_public, self.heartbeat_s)
        if self.n_routers:
            self.sim.start_routers(list(zip(self.router_names, self.router_keys, strict=True)))
        named = zip(self.agent_names, self.agent_keys, strict=True)
        agents = [(i, n, k) for i, (n, k) in enumerate(named)]
        self.sim.start_agents(agents, self.agent_processes)

    def stop(self) -> None:
        if self.sim is not None:
            self.sim.stop()
        if self.proc is not None:
            self.proc.stop()

    # -- asking ------------------------------------------------------------------------

    def token(self) -> str:
        return (self.etc / "secrets" / "admin.token").read_text().strip()

    def get(self, path: str, timeout: float = 30.0) -> requests.Response:
        r = requests.get(self.admin_url + path, timeout=timeout,
                         headers={"Authorization": f"Bearer {self.token()}"})  # fmt: skip
        r.raise_for_status()
        return r

    def post(self, path: str, body: dict) -> dict:
        r = requests.post(self.admin_url + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {self.token()}"})  # fmt: skip
        r.raise_for_status()
        return r.json()

    def ctl(self, *args: str):
        """The real `llmgw` CLI against this scheduler."""
        return llmgw("--admin-url", self.admin_url, *args,
                     env={"LLMGW_ADMIN_TOKEN": self.token(), "LLMGW_CONFIG": ""})  # fmt: skip

    def add_model(self, name: str) -> float:
        """A catalog change (`llmgw models add`, an on-demand model): when it was asked."""
        asked = time.time()
        self.post("/v1/models", {"name": name, "source": str(self.tmp / "weights.gguf"),
                                 "engine": ENGINE, "engine_version": "1",
                                 "profile": {"memory_bytes": MODEL_MEMORY},
                                 "scaling": {"min": 0, "max": 1}})  # fmt: skip
        return asked

    @property
    def replicas_wanted(self) -> int:
        return self.n_models * REPLICAS_PER_MODEL
