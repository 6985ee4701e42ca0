"""Engines on this node: what is installed, installing one, and the command that starts it.

An engine is NAME-VERSION. Two are built in: `llama.cpp` (llama.cpp's own llama-server,
built from the source vendored in the pinned llama-cpp-python sdist, the same way
scripts/build-llama-server does) and `vllm` (pip-installed into its own virtual
environment; GPU nodes only). `[[agent.engines]]` adds commands the agent does not
install: they count as installed (tests run the fake engine this way).

Every version lives in its own directory, <state_dir>/engines/NAME-VERSION/, and is
moved into place only when finished, so a half-done install never counts as installed.
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw import log
from llmgw.config import AgentConfig, EngineConfig
from llmgw.files import sha256_of
from llmgw_agentd.errors import EngineError
from llmgw_agentd.workers import leader_args

_log = log.get("llmgw.agentd.engines")

INSTALLING, INSTALLED, FAILED = "installing", "installed", "failed"
STATES = (INSTALLING, INSTALLED, FAILED)
LLAMA, VLLM = "llama.cpp", "vllm"
REASON_LINES = 20
_PERCENT = re.compile(rb"^\[ *(\d+)%\]")
# Installed beside vLLM in its environment: a replica across nodes runs on Ray (cgraph:
# the compiled graphs vLLM's pipeline parallelism uses on Ray). pip resolves a version
# that the pinned vLLM accepts.
RAY_REQUIREMENT = "ray[cgraph]"
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


@dataclass(frozen=True)
class Launch:
    """What a shard's command is made of, whatever the engine."""

    model_path: str
    host: str
    port: int
    key_file: str
    context: int
    parallel: int
    gpus: int = 0
    args: tuple[str, ...] = ()
    # The model's name in the catalog: engines answer with it as `model`, not the path.
    served_name: str = ""
    # A replica across nodes: its workers' HOST:PORT and each one's part (workers.py).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()


def llama_command(binary: Path, launch: Launch) -> list[str]:
    # llama-server splits -c across its -np slots; a profile's context is per slot.
    # --swa-full: a model with sliding-window attention (Gemma 2 and 3, ...) keeps every
    # layer's whole cache, so a cached prompt can be cut back to any prefix. Without it
    # llama-server can restore only checkpoints, and a conversation whose system prompt
    # the engine evaluated before, in a slot another conversation took since, gets it
    # evaluated again (bench/ROUTING-RUNS.md, runs 34-38). gguf.estimate() reserves this
    # memory already; models without sliding windows ignore the flag.
    return [
        str(binary), "-m", launch.model_path, "--host", launch.host,
        "--port", str(launch.port), "--api-key-file", launch.key_file,
        "-c", str(launch.context * launch.parallel), "-np", str(launch.parallel),
        "--swa-full", "--metrics", *_named("--alias", launch),
        *(leader_args(list(launch.rpc), list(launch.tensor_split)) if launch.rpc else ()),
        *launch.args,
    ]  # fmt: skip


def _named(flag: str, launch: Launch) -> list[str]:
    return [flag, launch.served_name] if launch.served_name else []


def vllm_command(venv: Path, launch: Launch) -> list[str]:
    return [
        str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", launch.model_path, "--host", launch.host, "--port", str(launch.port),
        "--max-model-len", str(launch.context), "--max-num-seqs", str(launch.parallel),
        "--tensor-parallel-size", str(max(1, launch.gpus)),
        *_named("--served-model-name", launch), *launch.args,
    ]  # fmt: skip


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
    """Installs engines in background threads; `notify(engine_id, state, reason)` on change."""

    def __init__(
        self,
        cfg: AgentConfig,
        state_dir: Path,
        has_gpu: Callable[[], bool],
        notify: Callable[[str, str, str], None],
    ):
        self.cfg = cfg
        self.root = state_dir / "engines"
        self.has_gpu = has_gpu
        self.notify = notify
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
        return name in (LLAMA, VLLM) or self.custom(name, version) is not None

    def _dir(self, name: str, version: str) -> Path:
        return self.root / f"{name}-{version}"

    def _installed_on_disk(self, name: str, version: str) -> bool:
        if name == LLAMA:
            return (self._dir(name, version) / "bin" / "llama-server").exists()
        if name == VLLM:
            # Without ray it cannot span nodes: an older install is installed again.
            d = self._dir(name, version)
            return (d / ".installed").exists() and (d / "bin" / "ray").exists()
        return False

    def is_installed(self, name: str, version: str) -> bool:
        return self.custom(name, version) is not None or self._installed_on_disk(name, version)

    def report(self) -> dict:
        """The `engines` body: every engine this node has or is installing."""
        out = {f"{e.name}-{e.version}": {"state": INSTALLED, "reason": ""}
               for e in self.cfg.engines if e.version}  # fmt: skip
        if self.root.is_dir():
            for d in self.root.iterdir():
                name, _, version = d.name.rpartition("-")
                if name and self._installed_on_disk(name, version):
                    out[d.name] = {"state": INSTALLED, "reason": ""}
        with self._lock:
            for engine_id, (state, reason) in self._states.items():
                if state != INSTALLED:
                    out[engine_id] = {"state": state, "reason": reason}
        return out

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
            self.notify(f"{name}-{version}", INSTALLED, "")
            return

        def run():
            try:
                self.ensure(name, version)
            except EngineError:
                pass  # ensure() reported it

        threading.Thread(target=run, name=f"install-{name}-{version}", daemon=True).start()

    def ensure(self, name: str, version: str) -> None:
        """Install if needed, blocking; raise EngineError with the reason if it fails.

        Two shards asking for the same engine share one install: the second waits on
        the first's lock and then finds it installed.
        """
        engine_id = f"{name}-{version}"
        if self.is_installed(name, version):
            return
        if not self.known(name, version):
            raise EngineError(f"engine {engine_id} is not known on this node")
        with self._lock:
            lock = self._installs.setdefault(engine_id, threading.Lock())
        with lock:
            if self._installed_on_disk(name, version):
                return
            self._set(engine_id, INSTALLING)
            try:
                if name == LLAMA:
                    self._install_llama(version)
                else:
                    self._install_vllm(version)
            except EngineError as e:
                self._set(engine_id, FAILED, str(e))
                raise
            except OSError as e:
                self._set(engine_id, FAILED, f"{engine_id}: {e}")
                raise EngineError(f"{engine_id}: {e}") from None
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

    def _install_llama(self, version: str) -> None:
        engine_id = f"{LLAMA}-{version}"
        target = self._dir(LLAMA, version) / "bin" / "llama-server"
        target.parent.mkdir(parents=True, exist_ok=True)
        cached = self.cache / engine_id / "bin" / "llama-server"
        stamp = patch_stamp(version)
        # A cached build from before a patch (or with another one) is built again.
        if cached.exists() and stamp_of(self.cache / engine_id) == stamp:
            _log.info("install_from_cache", engine=engine_id, source=cached)
            rpc = cached.with_name("rpc-server")
            if rpc.exists():  # before llama-server: its presence means installed
                self._place(rpc, target.with_name("rpc-server"))
            self._stamp(target.parent.parent, stamp)
            self._place(cached, target)
            return
        work = self.root / "build" / engine_id
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log_file = work / "build.log"
        _log.info(
            "install_building", engine=engine_id, log=log_file, hint="about 7 minutes on two cores"
        )
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
        # LLAMA_USE_PREBUILT_UI would download the web UI from the internet.
        self._run(["cmake", "-S", str(src), "-B", str(work / "build"),
                   "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
                   "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF", "-DGGML_RPC=ON"],
                  log_file, "configure", engine_id)  # fmt: skip
        # llama.cpp's target is ggml-rpc-server; installed, as its docs call it, rpc-server.
        self._run(["cmake", "--build", str(work / "build"), "--target", "llama-server",
                   "ggml-rpc-server", f"-j{os.cpu_count() or 1}"],
                  log_file, "build", engine_id)  # fmt: skip
        self._place(work / "build" / "bin" / "ggml-rpc-server", target.with_name("rpc-server"))
        self._stamp(target.parent.parent, stamp)
        self._place(work / "build" / "bin" / "llama-server", target)
        shutil.rmtree(work, ignore_errors=True)

    def rpc_server(self, name: str, version: str) -> Path:
        """llama.cpp's rpc-server for a worker shard, placed from the build cache if this
        node's install predates it; EngineError if there is none to be had."""
        if name != LLAMA:
            raise EngineError(f"engine {name}-{version} cannot run a shard across nodes")
        self.ensure(name, version)
        target = self._dir(name, version) / "bin" / "rpc-server"
        if not target.exists():
            cached = self.cache / f"{name}-{version}" / "bin" / "rpc-server"
            if not cached.exists():
                raise EngineError(
                    f"{name}-{version} on this node has no rpc-server: build it with"
                    " scripts/build-llama-server (GGML_RPC) into the engine cache"
                )
            with self._lock:
                self._place(cached, target)
        return target

    @staticmethod
    def _stamp(engine_dir: Path, stamp: str) -> None:
        """Record the patches of the build placed in `engine_dir` (before llama-server:
        its presence means installed)."""
        tmp = engine_dir / "PATCHES.tmp"
        tmp.write_text(stamp)
        tmp.rename(engine_dir / "PATCHES")

    @staticmethod
    def _place(source: Path, target: Path) -> None:
        tmp = target.with_name(target.name + ".tmp")
        shutil.copy2(source, tmp)
        tmp.chmod(0o755)
        tmp.rename(target)

    def _install_vllm(self, version: str) -> None:
        engine_id = f"{VLLM}-{version}"
        if not self.has_gpu():
            raise EngineError(f"{engine_id} needs a GPU and this node has none")
        venv = self._dir(VLLM, version)
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        log_file = self.root / f"{engine_id}.install.log"
        log_file.unlink(missing_ok=True)
        self._run([sys.executable, "-m", "venv", str(venv)], log_file, "venv", engine_id)
        self._run(
            [str(venv / "bin" / "pip"), "install", f"vllm=={version}", RAY_REQUIREMENT],
            log_file,
            "pip install",
            engine_id,
        )
        (venv / ".installed").write_text(version + "\n")

    # -- starting --------------------------------------------------------------------------

    def command(self, name: str, version: str, launch: Launch) -> tuple[list[str], dict]:
        """(argv, extra environment) that start this engine for `launch`."""
        custom = self.custom(name, version)
        if custom is not None:
            if not custom.command:
                raise EngineError(f"engine {name}: [[agent.engines]] has no command")
            return template_command(custom.command, launch), {}
        if name == LLAMA:
            return llama_command(self._dir(name, version) / "bin" / "llama-server", launch), {}
        if name == VLLM:
            # The key goes in the environment, not argv, where `ps` would show it.
            key = Path(launch.key_file).read_text().strip()
            return vllm_command(self._dir(name, version), launch), {"VLLM_API_KEY": key}
        raise EngineError(f"engine {name}-{version} is not known on this node")

    def health(self, name: str, version: str) -> str:
        custom = self.custom(name, version)
        return custom.health if custom is not None else "/health"
