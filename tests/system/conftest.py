"""A whole llmgw on loopback: the real scheduler, agents and router, with the fake engine."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from tests.helpers import BIN, ROOT, Proc, eventually, free_port, free_range, llmgw

GiB = 1 << 30
ENGINE_CMD = [
    sys.executable,
    str(ROOT / "tests" / "fake_engine.py"),
    "--port",
    "{port}",
    "--key-file",
    "{key_file}",
]


# An engine that fails the same way every time, as one whose weights it cannot load does.
BROKEN_CMD = [
    sys.executable,
    "-c",
    "import sys; print('llama_model_load: error loading model: bad magic'); sys.exit(1)",
]


def toml_list(items) -> str:
    return json.dumps(list(items))


def read_shards(state_dir: Path) -> list[dict]:
    """The shards an agent with this state directory records (what runs on its node)."""
    d = state_dir / "shards"
    out = []
    for p in sorted(d.glob("*.json")) if d.exists() else ():
        try:
            out.append(json.loads(p.read_text()))
        except FileNotFoundError:
            continue  # the agent removed it between the listing and the read
    return out


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.etc = tmp / "etc"
        self.etc.mkdir(exist_ok=True)
        # Every scheduler's ports by name; the first is the one the helpers below use
        # unless told otherwise. add_scheduler() makes a fleet with a standby.
        self.sched_ports: dict[str, dict] = {}
        self.sched_etc: dict[str, Path] = {}  # a scheduler's own config dir, if not etc
        self.add_scheduler("s1")
        self.schedulers: dict[str, Proc] = {}
        self.settle_s = 1.5
        self.start_timeout_s = 20.0  # a real vLLM takes longer to start than that
        self.lease = "lease_s = 3.0\nrenew_s = 0.5\nstep_down_s = 2.0\nstandby_retry_s = 0.3\n"
        self.admin_scheme = "http"
        self.scheduler_extra = ""  # more [scheduler] lines, e.g. for TLS
        self.backoff_s = (0.5, 2.0)  # scheduler.backoff_base_s, backoff_max_s
        self.scheduler_env: dict[str, str] = {}  # e.g. REQUESTS_CA_BUNDLE for a source
        self.models: list[dict] = []
        self.models_toml = ""  # more [[models]] tables as they are, e.g. LoRA adapters
        self.scheduler: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self.router: Proc | None = None
        self.router_url = ""
        self.secret = ""
        self.router_env: dict[str, str] = {}  # e.g. LLMGW_STORE through tests/blackhole.py
        self.router_extra = ""  # more config after [router]'s lines, e.g. a [store] table

    def add_scheduler(self, name: str, own_config_dir: bool = False) -> None:
        """Another scheduler sharing the store (PostgreSQL for a standby); agents and the
        router are configured with every scheduler added before they start.
        `own_config_dir`: its own config directory, as on a machine of its own, with what
        install.md says to copy there (the scheduler's keypair and the admin token)."""
        if own_config_dir:
            self.sched_etc[name] = self.tmp / f"etc-{name}"
        self.sched_ports[name] = {
            "bus": f"tcp://127.0.0.1:{free_port()}",
            "pub": f"tcp://127.0.0.1:{free_port()}",
            "metrics": free_port(),
            "admin": free_port(),
        }

    @property
    def bus(self) -> str:
        return self.sched_ports["s1"]["bus"]

    @property
    def pub(self) -> str:
        return self.sched_ports["s1"]["pub"]

    @property
    def sched_metrics(self) -> int:
        return self.sched_ports["s1"]["metrics"]

    @property
    def admin_port(self) -> int:
        return self.sched_ports["s1"]["admin"]

    def _all(self, what: str) -> str:
        return toml_list(p[what] for p in self.sched_ports.values())

    # -- config ------------------------------------------------------------------------

    def _common(self, state_dir: Path, etc: Path | None = None) -> str:
        return (
            f'[paths]\nconfig_dir = "{etc or self.etc}"\nstate_dir = "{state_dir}"\n'
            f'[log]\nlevel = "debug"\n'
        )

    def _engines(self) -> str:
        return (
            f'[[agent.engines]]\nname = "fake"\nversion = "1"\ncommand = {toml_list(ENGINE_CMD)}\n'
            '[[agent.engines]]\nname = "broken"\nversion = "1"\n'
            f"command = {toml_list(BROKEN_CMD)}\n"
        )

    def add_model(
        self,
        name: str,
        memory: int = GiB,
        min_: int = 1,
        max_: int = 1,
        source: str = "",
        engine: str = "fake",
        version: str = "1",
        profile: str = "",
        keep_alive: float = 300.0,
        sha256: str = "",
        scaling: str = "",
    ) -> None:
        """A model for the fake engine, unless `engine`, `source` and `profile` (TOML lines
        for [models.profile]) say otherwise; `scaling`: more [models.scaling] lines."""
        self.models.append(
            {
                "name": name,
                "memory": memory,
                "min": min_,
                "max": max_,
                "source": source,
                "engine": engine,
                "version": version,
                "profile": profile,
                "keep_alive": keep_alive,
                "sha256": sha256,
                "scaling": scaling,
            }
        )

    def _models(self) -> str:
        weights = self.tmp / "weights.gguf"
        weights.write_bytes(b"not really a model")
        out = []
        for m in self.models:
            memory = f"memory_bytes = {m['memory']}\n" if m["memory"] else ""
            out.append(
                f'[[models]]\nname = "{m["name"]}"\nsource = "{m["source"] or weights}"\n'
                + (f'sha256 = "{m["sha256"]}"\n' if m["sha256"] else "")
                + f'engine = "{m["engine"]}"\nengine_version = "{m["version"]}"\n'
                f"[models.profile]\n{memory}{m['profile']}"
                f"[models.scaling]\nmin = {m['min']}\nmax = {m['max']}\n"
                f"keep_alive_s = {m['keep_alive']}\n{m['scaling']}"
            )
        return "".join(out) + self.models_toml

    # -- processes ---------------------------------------------------------------------

    def start_scheduler(self, name: str = "s1") -> Proc:
        ports = self.sched_ports[name]
        suffix = "" if name == "s1" else f"-{name}"
        cfg = self.tmp / f"scheduler{suffix}.toml"
        etc = self.sched_etc.get(name)
        if etc is not None:
            self.copy_control_plane_files(etc)
        cfg.write_text(
            self._common(self.tmp / f"scheduler-state{suffix}", etc)
            + f'[scheduler]\nname = "{name}"\nbus = "{ports["bus"]}"\n'
            f'publish = "{ports["pub"]}"\n'
            f'metrics_listen = "127.0.0.1:{ports["metrics"]}"\ntick_s = 0.2\n'
            f'admin_listen = "127.0.0.1:{ports["admin"]}"\n'
            f"node_lost_s = 3.0\nsnapshot_s = 1.0\nsettle_s = {self.settle_s}\n"
            f"backoff_base_s = {self.backoff_s[0]}\nbackoff_max_s = {self.backoff_s[1]}\n"
            f"start_timeout_s = {self.start_timeout_s}\n"
            + self.lease
            + self.scheduler_extra
            + self._engines()
            + self._models()
        )
        proc = Proc(
            [str(BIN / "llmgw-scheduler"), "--config", str(cfg)],
            self.tmp / f"scheduler{suffix}.log",
            env=self.scheduler_env,
            health=f"http://127.0.0.1:{ports['metrics']}/metrics",
        )
        proc.wait_healthy()
        self.schedulers[name] = proc
        if name == "s1":
            self.scheduler = proc
        return proc

    def copy_control_plane_files(self, etc: Path, *names: str) -> None:
        """Copy into another scheduler's config dir what install.md says to copy there:
        the scheduler's keypair, the bootstrap admin token, and the keypairs `names`."""
        curve = etc / "pki" / "curve"
        curve.mkdir(parents=True, exist_ok=True)
        (etc / "secrets").mkdir(exist_ok=True)
        token = self.etc / "secrets" / "admin.token"
        if token.exists():
            shutil.copy2(token, etc / "secrets" / "admin.token")
        for name in ("scheduler", *names):
            for suffix in (".key", ".key_secret"):
                if (self.etc / "pki" / "curve" / f"{name}{suffix}").exists():
                    shutil.copy2(self.etc / "pki" / "curve" / f"{name}{suffix}", curve)

    def ctl(self, *args: str, scheduler: str = "s1") -> subprocess.CompletedProcess:
        """Run the real `llmgw` against this cluster's admin API (its token file included)."""
        cfg = self.tmp / "ctl.toml"
        cfg.write_text(self._common(self.tmp / "ctl-state"))
        return llmgw(
            "--config",
            str(cfg),
            "--admin-url",
            f"{self.admin_scheme}://127.0.0.1:{self.sched_ports[scheduler]['admin']}",
            *args,
            env={"LLMGW_CONFIG": "", "LLMGW_ADMIN_URL": "", "LLMGW_ADMIN_TOKEN": ""},
            check=False,
        )

    def register(self, name: str, kind: str = "nodes") -> None:
        """`llmgw nodes/routers add`: through the admin API once the scheduler runs."""
        if self.scheduler is not None and self.scheduler.p.poll() is None:
            result = self.ctl(kind, "add", name)
            assert result.returncode == 0, result.stderr
        else:
            llmgw("--config", str(self.tmp / "ctl.toml"), kind, "add", name, "--store",
                  env={"LLMGW_CONFIG": ""})  # fmt: skip

    def start_agent(self, name: str, memory: int, register: bool = True,
                    extra: str = "", env: dict | None = None) -> Proc:  # fmt: skip
        """`extra`: more [agent] lines (fabric_address = …); `env`: its environment's
        changes (PATH with a fake nvidia-smi)."""
        (self.tmp / "ctl.toml").write_text(self._common(self.tmp / "ctl-state"))
        if register and not (self.etc / "pki" / "curve" / f"{name}.key_secret").exists():
            self.register(name)
        lo, hi = free_range()
        cfg = self.tmp / f"agent-{name}.toml"
        cfg.write_text(
            self._common(self.tmp / f"agent-{name}")
            + f'[agent]\nname = "{name}"\nschedulers = {self._all("bus")}\nheartbeat_s = 0.5\n'
            f"memory_bytes = {memory}\nport_min = {lo}\nport_max = {hi}\n"
            'metrics_listen = "127.0.0.1:0"\n' + extra + self._engines()
        )
        proc = Proc(
            [str(BIN / "llmgw-agentd"), "--config", str(cfg)],
            self.tmp / f"agent-{name}.log",
            env=env,
        )
        self.agents[name] = proc
        return proc

    def start_router(self, secret: str) -> Proc:
        self.register("router", "routers")
        cfg = self.tmp / "router.toml"
        port = free_port()
        cfg.write_text(
            self._common(self.tmp / "router-state")
            + f'[router]\nlisten = "127.0.0.1:{port}"\nschedulers = {self._all("pub")}\n'
            f"scheduler_bus = {self._all('bus')}\nactivation_window_s = 20.0\n"
            'bus_name = "router"\nkey_refresh_s = 0.2\ncooldown_s = 0.5\n' + self.router_extra
        )
        self.router_url = f"http://127.0.0.1:{port}"
        self.secret = secret
        self.router = Proc(
            [str(BIN / "llmgw-router"), "--config", str(cfg)],
            self.tmp / "router.log",
            env=self.router_env,
            health=f"{self.router_url}/ready",
        )
        self.router.wait_healthy()
        return self.router

    # -- looking ---------------------------------------------------------------------------

    def chat(self, model: str, timeout: float = 5.0) -> requests.Response:
        return requests.post(
            f"{self.router_url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {self.secret}"},
            timeout=timeout,
        )

    def serves(self, model: str) -> bool:
        try:
            return self.chat(model).status_code == 200
        except requests.RequestException:
            return False

    def admin(self, path: str, scheduler: str = "s1"):
        """GET the admin API's JSON (fast enough to poll, unlike running `llmgw`)."""
        token = (self.etc / "secrets" / "admin.token").read_text().strip()
        port = self.sched_ports[scheduler]["admin"]
        # https: verified by the cluster CA where certmon made one (verify=False warns).
        ca = self.etc / "pki" / "ca.crt"
        verify = True if self.admin_scheme == "http" else str(ca) if ca.exists() else False
        r = requests.get(
            f"{self.admin_scheme}://127.0.0.1:{port}{path}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
            verify=verify,
        )
        r.raise_for_status()
        return r.json()

    def metric(self, name: str, scheduler: str = "s1", default: float | None = 0.0) -> float:
        """A series' value from a scheduler's /metrics; `default` if it is not published
        (None: fail)."""
        port = self.sched_ports[scheduler]["metrics"]
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        assert default is not None, f"{name} is not published by {scheduler}"
        return default

    def shards(self, node: str) -> list[dict]:
        """The shards an agent's state files record (what runs on that node)."""
        return read_shards(self.tmp / f"agent-{node}")

    def engine_pids(self) -> set[int]:
        """Every fake engine process running on this machine for this cluster."""
        pids = set()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(b"fake_engine.py" in c for c in cmd) and any(
                str(self.tmp).encode() in c for c in cmd
            ):
                pids.add(int(p.name))
        return pids

    def stop(self) -> None:
        """Stop every tool, then every engine: the fake ones, and the real ones each
        agent's state files record (an agent leaves its engines running by design)."""
        for proc in [self.router, *self.schedulers.values(), *self.agents.values()]:
            if proc is not None:
                proc.stop()
        pids = self.engine_pids() | {s["pid"] for node in self.agents for s in self.shards(node)}
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


class Traffic:
    """Requests for `model` through the router, one after another, until stopped: how a
    failover or a restart looks to clients. Counts what was answered and what failed."""

    def __init__(self, cluster: Cluster, model: str = "m", pause_s: float = 0.02):
        self.cluster, self.model, self.pause_s = cluster, model, pause_s
        self.ok, self.failed = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                r = self.cluster.chat(self.model)
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"HTTP {r.status_code} {r.text[:200]}")
            except requests.RequestException as e:
                self.failed.append(repr(e))
            self._stop.wait(self.pause_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture
def source(tmp_path):
    """An HTTPS weights source with one 2 MiB GGUF, `m.gguf`, that counts downloads."""
    from tests.weights_server import WeightsServer

    data = b"GGUF" + os.urandom(2 << 20)
    server = WeightsServer({"m.gguf": data}, tls_dir=tmp_path / "source-tls")
    server.data = data
    yield server
    server.stop()


@pytest.fixture
def tls_cluster(cluster):
    """A cluster whose scheduler serves its admin API on HTTPS with a certificate from
    the cluster CA (what join tokens and onboarding need), started without models."""
    from tests.system.test_tls import certmon

    pki = certmon(cluster.etc, "init-ca")
    certmon(cluster.etc, "issue", "localhost", "--san", "127.0.0.1", "--san", "localhost")
    cluster.scheduler_extra = (
        f'admin_tls_cert = "{pki / "localhost.crt"}"\nadmin_tls_key = "{pki / "localhost.key"}"\n'
    )
    cluster.admin_scheme = "https"
    return cluster


@pytest.fixture
def served(cluster, api_key):
    """A cluster serving model 'm' from node-a (node-b is too small for it)."""
    cluster.add_model("m", memory=GiB)
    cluster.start_scheduler()
    cluster.start_agent("node-a", memory=2 * GiB)
    cluster.start_agent("node-b", memory=GiB // 2)
    cluster.start_router(api_key[1])
    eventually(lambda: cluster.serves("m"), timeout=30, what="model m to be served")
    return cluster
