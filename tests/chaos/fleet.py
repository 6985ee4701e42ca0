"""A fleet to break: two schedulers on PostgreSQL, two agents, two routers, fake engines.

Processes killed with SIGKILL are started again by the test, as systemd would; each
start gets a fresh log and the old one is kept beside it, so what every process ever
logged (the replica starts above all) can be counted at the end.
"""

import requests

from tests.helpers import BIN, Proc, free_port
from tests.system.conftest import Cluster, GiB

# Room for one replica of m (1 GiB) on a node, so the two are on different nodes.
NODE_MEMORY = GiB + GiB // 2

# Each engine takes a while to answer, so that a kill finds requests in flight at every
# stage: waiting for the first token, between tokens, reading a whole answer.
SLOW = {"chunks": 8, "delay_s": 0.02, "first_delay_s": 0.05}


def keep_log(path) -> None:
    """Move a log aside (NAME.1.log, NAME.2.log, …) before its process starts again."""
    if not path.exists():
        return
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(kept)


class ChaosCluster(Cluster):
    def __init__(self, tmp):
        super().__init__(tmp)
        self.routers: dict[str, Proc] = {}
        self.router_urls: dict[str, str] = {}

    def start_scheduler(self, name: str = "s1") -> Proc:
        keep_log(self.tmp / ("scheduler.log" if name == "s1" else f"scheduler-{name}.log"))
        return super().start_scheduler(name)

    def start_agent(self, name: str, memory: int, register: bool = True) -> Proc:
        keep_log(self.tmp / f"agent-{name}.log")
        return super().start_agent(name, memory, register)

    def start_named_router(self, name: str) -> Proc:
        """Router `name` on its own port, the same one each time it is started again."""
        cfg = self.tmp / f"router-{name}.toml"
        if not cfg.exists():
            self.register(name, "routers")
            port = free_port()
            cfg.write_text(
                self._common(self.tmp / f"router-{name}-state")
                + f'[router]\nlisten = "127.0.0.1:{port}"\n'
                f"schedulers = {self._all('pub')}\nscheduler_bus = {self._all('bus')}\n"
                f'activation_window_s = 20.0\nbus_name = "{name}"\nkey_refresh_s = 0.2\n'
                "cooldown_s = 0.5\n"
                + self._engines()  # one llmgw.toml everywhere, as deployed
                + self._models()
            )
            self.router_urls[name] = f"http://127.0.0.1:{port}"
        log = self.tmp / f"router-{name}.log"
        keep_log(log)
        proc = Proc(
            [str(BIN / "llmgw-router"), "--config", str(cfg)],
            log,
            health=f"{self.router_urls[name]}/ready",
        )
        proc.wait_healthy()
        self.routers[name] = proc
        return proc

    def serves_at(self, url: str, model: str) -> bool:
        try:
            r = requests.post(
                f"{url}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {self.secret}"},
                timeout=5,
            )
        except requests.RequestException:
            return False
        return r.status_code == 200

    def logs(self, pattern: str) -> str:
        """Every log matching `pattern`, kept ones included, run together."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob(pattern)))

    def slow_engines(self) -> None:
        """Make every running engine answer at SLOW's pace (a new one starts quick)."""
        for node in self.agents:
            for shard in self.shards(node):
                if shard.get("port"):
                    requests.post(
                        f"http://127.0.0.1:{shard['port']}/_control", json=SLOW, timeout=5
                    ).raise_for_status()

    def stop(self) -> None:
        for proc in self.routers.values():
            proc.stop()
        super().stop()


def role(cluster: Cluster, name: str) -> str:
    """What scheduler `name` says it is: leader, standby, or down if it does not answer."""
    try:
        return cluster.admin("/v1/status", scheduler=name)["control_plane"]["role"]
    except Exception:
        return "down"


def ready(cluster: Cluster, name: str) -> int:
    return sum(1 for r in cluster.admin("/v1/replicas", scheduler=name) if r["state"] == "ready")
