"""What the benchmark runs: the fake engine and the targets in front of it, each a process
(tree) pinned to a CPU, started and stopped cleanly, with its CPU time readable."""

import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WORK = BENCH / ".work"
VENV_BIN = Path(sys.executable).parent
MODEL = "bench"
INSTALL_HINT = "apt-get install nginx-light wrk"


class Skip(Exception):
    """A target that cannot run here; the message says why."""


# --- processes ---------------------------------------------------------------------------


def clean_env(**extra) -> dict:
    """The environment for children: no HTTP proxies (all traffic is to 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def pinned(cmd: list[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if cpu is not None else cmd


def spawn(cmd: list[str], log: Path, cpu: int | None, env: dict | None = None, cwd=None):
    """Start cmd in its own process group, output to log, pinned to cpu."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            pinned(cmd, cpu),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or clean_env(),
            cwd=cwd,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """Stop a process started by spawn() and everything in its group."""
    if proc is None or proc.poll() is not None:
        _killpg(proc, signal.SIGKILL)  # stray children of a dead leader
        return
    _killpg(proc, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    _killpg(proc, signal.SIGKILL)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass


def _killpg(proc, sig) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # the group id is the leader's pid (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def http_get(url: str, timeout: float = 2.0) -> int:
    """The status of GET url (0 if it could not be reached), never through a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return 0


def wait_ready(url: str, proc, log: Path, timeout_s: float, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Skip(f"{name} exited with {proc.returncode} while starting:\n{log_tail(log)}")
        if http_get(url) == 200:
            return
        time.sleep(0.2)
    raise Skip(f"{name} not ready at {url} after {timeout_s:.0f}s:\n{log_tail(log)}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- CPU accounting ----------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def cpu_ns(pids: list[int]) -> int:
    """CPU time (user + system) of the processes' threads, in ns.

    Summed from /proc/PID/task/TID/schedstat (nanosecond precision); utime+stime in
    /proc/PID/stat count in clock ticks (10 ms), too coarse for a few thousand requests
    through nginx. Used as the fallback where schedstat is unavailable."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        from_schedstat = 0
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    from_schedstat += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        if from_schedstat:
            total += from_schedstat
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        total += ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return total


# --- the fake engine ---------------------------------------------------------------------


class Engine:
    def __init__(self, cpu: int | None, chunks: int, gap_ms: float, chat_only: bool = False):
        self.cpu, self.chunks, self.gap_ms = cpu, chunks, gap_ms
        self.chat_only = chat_only
        self.port = free_port()
        self.proc = None
        self.log = WORK / ("engine-chat-only.log" if chat_only else "engine.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, str(BENCH / "fake_engine.py"), "--port", str(self.port),
               "--chunks", str(self.chunks), "--gap-ms", str(self.gap_ms)]  # fmt: skip
        if self.chat_only:
            cmd.append("--chat-only")
        self.proc = spawn(cmd, self.log, self.cpu)
        try:
            wait_ready(self.url + "/health", self.proc, self.log, 10, "fake engine")
        except Skip as e:
            raise RuntimeError(str(e)) from None

    def stop(self) -> None:
        stop(self.proc)


# --- targets -----------------------------------------------------------------------------


class Target:
    """Something to send chat completions to. Direct to the engine unless a subclass
    starts a proxy in front of it."""

    name = "direct"
    label = "direct (fake engine)"

    def __init__(self, engine: Engine, cpu: int | None):
        self.engine, self.cpu = engine, cpu
        self.port = engine.port
        self.api_key = ""
        self.proc: subprocess.Popen | None = None
        self.log = WORK / f"{self.name}.log"
        self.version = ""
        self.notes: list[str] = []

    @property
    def is_proxy(self) -> bool:
        return self.proc is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        stop(self.proc)

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def pids(self) -> list[int]:
        return process_tree(self.proc.pid) if self.proc is not None else []

    def finish(self) -> None:
        """After measuring, before stopping: add notes (e.g. what the proxy recorded)."""


class Nginx(Target):
    name = "nginx"
    label = "nginx (reverse proxy)"

    def start(self) -> None:
        binary = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
        )
        if binary is None:
            raise Skip(f"nginx is not installed ({INSTALL_HINT})")
        prefix = WORK / "nginx"
        shutil.rmtree(prefix, ignore_errors=True)
        (prefix / "logs").mkdir(parents=True)
        self.port = free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(NGINX_CONF.format(prefix=prefix, port=self.port, engine=self.engine.port))
        out = subprocess.run([binary, "-v"], capture_output=True, text=True)
        self.version = out.stderr.strip().removeprefix("nginx version: ")
        self.proc = spawn(
            [binary, "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "logs/error.log")],
            self.log,
            self.cpu,
        )
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc, self.log, 10, "nginx")


NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    client_body_temp_path {prefix}/client_body_temp;
    proxy_temp_path {prefix}/proxy_temp;

    upstream engine {{
        server 127.0.0.1:{engine};
        keepalive 64;
        keepalive_requests 1000000;
    }}

    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


class LiteLLM(Target):
    name = "litellm"
    label = "LiteLLM proxy"
    venv = WORK / "litellm-venv"
    spec = "litellm[proxy]"

    def install(self) -> None:
        marker = self.venv / ".bench-installed"
        if marker.exists():
            return
        print(f"  installing {self.spec} into {self.venv} (first use; a few minutes)", flush=True)
        log = WORK / "litellm-install.log"
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(self.venv)],
            [str(self.venv / "bin/pip"), "install", "--quiet", "--upgrade", "pip"],
            [str(self.venv / "bin/pip"), "install", "--quiet", self.spec],
        ]
        with open(log, "wb") as out:
            for step in steps:
                try:
                    rc = subprocess.run(
                        step, stdout=out, stderr=subprocess.STDOUT, env=os.environ, timeout=1200
                    ).returncode
                except (OSError, subprocess.TimeoutExpired) as e:
                    raise Skip(f"installing LiteLLM failed: {e}") from None
                if rc != 0:
                    raise Skip(f"installing LiteLLM failed ({' '.join(step[-2:])}, see {log}):"
                               f"\n{log_tail(log, 5)}")  # fmt: skip
        marker.touch()

    def start(self) -> None:
        self.install()
        self.port = free_port()
        conf = WORK / "litellm.yaml"
        # LiteLLM refuses to start without a master key; clients then present it, much as
        # llmgw's clients present an API key.
        self.api_key = "sk-bench-" + secrets.token_hex(16)
        conf.write_text(
            LITELLM_CONF.format(model=MODEL, engine=self.engine.url, master_key=self.api_key)
        )
        out = subprocess.run(
            [str(self.venv / "bin/python"), "-c",
             "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True, text=True,
        )  # fmt: skip
        self.version = out.stdout.strip()
        env = clean_env(
            LITELLM_LOCAL_MODEL_COST_MAP="True",  # do not fetch the cost map from the internet
            LITELLM_LOG="ERROR",
            DISABLE_SCHEMA_UPDATE="True",
        )
        for var in ("DATABASE_URL", "LITELLM_MASTER_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
            env.pop(var, None)
        cmd = [str(self.venv / "bin/litellm"), "--config", str(conf), "--host", "127.0.0.1",
               "--port", str(self.port), "--num_workers", "1"]  # fmt: skip
        self.proc = spawn(cmd, self.log, self.cpu, env=env, cwd=WORK)
        url = f"http://127.0.0.1:{self.port}/health/liveliness"
        wait_ready(url, self.proc, self.log, 180, "LiteLLM")


LITELLM_CONF = """\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {engine}/v1
      api_key: bench-engine-key
litellm_settings:
  telemetry: false
general_settings:
  master_key: {master_key}
"""


class Router(Target):
    name = "llmgw"
    label = "llmgw-router (keys, usage, metrics)"
    bin = VENV_BIN  # where its llmgw and llmgw-router are

    def start(self) -> None:
        work = WORK / self.name  # each its own store and config
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        self.db = work / "bench.db"
        self.port = free_port()
        (work / "engine.key").write_text("bench-engine-key\n")
        config = work / "llmgw.toml"
        config.write_text(
            ROUTER_CONF.format(
                port=self.port, engine=self.engine.url, model=MODEL, router_extra=self.router_extra
            )
            + self.extra  # fmt: skip
        )
        env = clean_env(LLMGW_CONFIG=str(config), LLMGW_STORE=f"sqlite:///{self.db}")
        self.api_key = self.make_key(env)
        out = subprocess.run([str(self.bin / "llmgw-router"), "--version"], capture_output=True,
                             text=True, env=env)  # fmt: skip
        self.version = out.stdout.strip().split()[-1] if out.stdout.strip() else ""
        self.proc = spawn([str(self.bin / "llmgw-router"), "--config", str(config)],
                          self.log, self.cpu, env=env)  # fmt: skip
        wait_ready(f"http://127.0.0.1:{self.port}/ready", self.proc, self.log, 30, "llmgw-router")

    extra = ""  # more config after ROUTER_CONF
    router_extra = ""  # more keys in its [router] section

    def llmgw(self, env: dict, *args: str) -> str:
        out = subprocess.run([str(self.bin / "llmgw"), *args, "--store"], capture_output=True,
                             text=True, env=env)  # fmt: skip
        if out.returncode != 0:
            raise Skip(f"llmgw {' '.join(args[:2])} failed: {out.stderr.strip()[-500:]}")
        return out.stdout

    def make_key(self, env: dict) -> str:
        import json

        return json.loads(self.llmgw(env, "keys", "create", "--name", "bench", "--json"))["secret"]

    def finish(self) -> None:
        """Note how many usage rows the router wrote (it flushes at least every second)."""
        time.sleep(1.5)
        try:
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as db:
                rows = db.execute("SELECT count(*) FROM usage").fetchone()[0]
            self.notes.append(f"{rows} usage rows written")
        except sqlite3.Error as e:
            self.notes.append(f"usage rows unreadable: {e}")


ROUTER_CONF = """\
[log]
level = "info"

[paths]
state_dir = "."

[router]
listen = "127.0.0.1:{port}"
usage_spool_dir = "usage-spool"
{router_extra}
[[router.endpoints]]
id = "fake"
url = "{engine}"
models = ["{model}"]
key = "@engine.key"
"""


class NoSpoolRouter(Router):
    """The same router with its usage spool off (`router.usage_spool = false`): rows wait
    in memory only, as before the spool. Measured right after `llmgw`, for the spool's
    cost per request."""

    name = "llmgw-nospool"
    label = "llmgw-router with the usage spool off"
    router_extra = "usage_spool = false\n"


class AiohttpRouter(Router):
    """The same router served by aiohttp's server (`router.transport = "aiohttp"`), the
    transport before http1.py: what the router's own server saves."""

    name = "llmgw-aiohttp"
    label = "llmgw-router on aiohttp's server"
    router_extra = 'transport = "aiohttp"\n'


class FrontDoorRouter(Router):
    """The same router with a second endpoint, an engine that serves only chat: model
    `bench` answers Anthropic's Messages natively, `bench-chat` through translation."""

    name = "llmgw-frontdoor"
    label = "llmgw-router, Anthropic Messages native and translated"
    TRANSLATED_MODEL = "bench-chat"

    def start(self) -> None:
        self.chat_only = Engine(self.engine.cpu, self.engine.chunks, self.engine.gap_ms, True)
        self.chat_only.start()
        self.extra = (
            f'[[router.endpoints]]\nid = "chat-only"\nurl = "{self.chat_only.url}"\n'
            f'models = ["{self.TRANSLATED_MODEL}"]\nkey = "@engine.key"\n'
        )
        super().start()

    def stop(self) -> None:
        super().stop()
        self.chat_only.stop()


class LimitedRouter(Router):
    """The same router with limits, budgets and a band on the bench key: the key belongs
    to a user and a project of an org; rpm, tpm and concurrent limits, a token budget
    per day and a cost budget per month are set on it, all far above what the run
    uses; the model has prices and slots, so every request is reserved, settled,
    priced and admitted through them."""

    name = "llmgw+limits"
    label = "llmgw-router with limits, budgets and a band on the key"
    extra = """
[[models]]
name = "bench"
source = "/nonexistent/bench.gguf"
[models.profile]
parallel = 64
[models.pricing]
input_per_mtok = 0.1
output_per_mtok = 0.4
"""
    # Also limit the user, project, team and org (13 counters a request instead of 5).
    every_level = False

    def make_key(self, env: dict) -> str:
        import json

        run = lambda *a: self.llmgw(env, *a)  # noqa: E731
        run("orgs", "create", "bench-org")
        run("teams", "create", "bench-team", "--org", "bench-org")
        run("users", "create", "bench-user", "--team", "bench-team")
        run("projects", "create", "bench-project", "--team", "bench-team")
        key = json.loads(run("keys", "create", "--name", "bench", "--user", "bench-user",
                             "--project", "bench-project", "--band", "gold", "--json"))  # fmt: skip
        big = str(10**12)
        kid = key["id"]
        run("limits", "set", "--key", kid, "--rpm", big, "--tpm", big, "--concurrent", "1000")
        run("budgets", "set", "--key", kid, "--period", "day", "--tokens", big)
        run("budgets", "set", "--key", kid, "--period", "month", "--cost", "1000000")
        if self.every_level:
            for scope, name in (("user", "bench-user"), ("project", "bench-project"),
                                ("team", "bench-team"), ("org", "bench-org")):  # fmt: skip
                run("limits", "set", f"--{scope}", name, "--rpm", big, "--tpm", big)
        return key["secret"]


class EveryLevelRouter(LimitedRouter):
    """As LimitedRouter, with rpm and tpm limits on the user, project, team and org too
    (`bench/run.py --every-level`)."""

    name = "llmgw+limits*5"
    label = "llmgw-router with limits on the key, user, project, team and org"
    every_level = True


class RustRouter(Target):
    """A Rust router a user would put in front of vLLM instead (`make bench` installs it:
    the `bench` extra), round-robin over the one fake engine, bound to loopback."""

    dist = ""  # its PyPI name and executable
    launch: tuple[str, ...] = ()  # a subcommand before the options

    def start(self) -> None:
        import importlib.metadata

        binary = VENV_BIN / self.dist
        try:
            self.version = importlib.metadata.version(self.dist)
        except importlib.metadata.PackageNotFoundError:
            binary = None
        if binary is None or not binary.exists():
            raise Skip(f"{self.dist} is not installed (pip install -e '.[bench]')")
        self.port = free_port()
        cmd = [str(binary), *self.launch, "--worker-urls", self.engine.url,
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
        self.proc = spawn(cmd, self.log, self.cpu, cwd=WORK)
        wait_ready(f"http://127.0.0.1:{self.port}/health", self.proc, self.log, 60, self.dist)


class VllmRouter(RustRouter):
    name = dist = "vllm-router"
    label = "vllm-router (Rust, round_robin)"


class SglangRouter(RustRouter):
    name = dist = "sglang-router"
    label = "sglang-router (Rust, round_robin)"
    launch = ("launch",)


class BaselineRouter(Router):
    """llmgw-router as it was at a git revision (`bench/run.py --baseline REV`): REV's
    source unpacked under bench/.work, run by this venv's Python (REV's own dependencies
    are assumed to be this venv's), its ctl making its own store."""

    label = "llmgw-router at the baseline revision"

    def __init__(self, engine: Engine, cpu: int | None, rev: str):
        self.rev = rev
        self.name = f"llmgw@{rev}"
        super().__init__(engine, cpu)
        self.log = WORK / "llmgw-baseline.log"

    def start(self) -> None:
        self.bin = checkout(self.rev)
        super().start()
        self.version = self.rev


# The packages a revision's source holds, and where (pyproject's package-dir).
_PACKAGES = {"llmgw": "lib/llmgw", "llmgw_router": "tools/router", "llmgw_ctl": "tools/ctl"}
_SCRIPTS = {"llmgw": "llmgw_ctl.main:cli", "llmgw-router": "llmgw_router.main:main"}


def checkout(rev: str) -> Path:
    """REV's source under bench/.work/baseline/SHA (git archive, made once), and a bin
    directory of its llmgw and llmgw-router that import it ahead of this checkout."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        raise Skip(f"--baseline {rev}: not a commit here ({getattr(e, 'stderr', e)})") from None
    home = WORK / "baseline" / sha
    src, shim, bin_dir = home / "src", home / "shim", home / "bin"
    if not (home / ".made").exists():
        shutil.rmtree(home, ignore_errors=True)
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, capture_output=True,
                                 check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        shim.mkdir()
        for package, where in _PACKAGES.items():
            (shim / package).symlink_to(src / where)
        bin_dir.mkdir()
        for script, entry in _SCRIPTS.items():
            module, func = entry.split(":")
            path = bin_dir / script
            path.write_text(
                f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(shim)!r})\n"
                f"from {module} import {func}\nsys.exit({func}())\n"
            )
            path.chmod(0o755)
        (home / ".made").touch()
    return bin_dir


PEERS = {"nginx": Nginx, "litellm": LiteLLM, "vllm-router": VllmRouter,
         "sglang-router": SglangRouter}  # fmt: skip
