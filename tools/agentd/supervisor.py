"""Shards: engine processes this node runs, each serving one replica.

A shard's engine is started in its own session with its output going to a file, not a
pipe, so it outlives the agent (systemd `KillMode=process`): an agent restart must not
take every model on the node down with it. What the agent needs to find an engine
again — pid, start time, port — is written to <state_dir>/shards/ID.json, and on start
the agent adopts every engine that is still the same process and still healthy.

Starting (fetching weights, installing the engine, waiting for readiness) and stopping
(up to 10 s of grace) run in threads; `notify(shard_json)` is called on every state
change, from whichever thread made it.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import requests

from llmgw import bus, engines, log
from llmgw.config import AgentConfig
from llmgw.engines import ALONE, LEADER, PROCESS, TCP, WORKER
from llmgw.states import ShardState
from llmgw_agentd import drain, process, workers
from llmgw_agentd.engines import Installer, Launch, launch_of, tail_lines
from llmgw_agentd.errors import AgentError
from llmgw_agentd.shards import STARTING, Shard, engine_env
from llmgw_agentd.weights import Weights, entry_keys

_log = log.get("llmgw.agentd.supervisor")

READY, DRAINING = ShardState.READY, ShardState.DRAINING
STOPPED, FAILED = ShardState.STOPPED, ShardState.FAILED
STATES = (STARTING, READY, DRAINING, STOPPED, FAILED)
LOST = bus.GONE_AFTER_AGENT_RESTART

STOP_GRACE_S = 10.0
START_TIMEOUT_S = 600.0  # as scheduler.start_timeout_s: a 70B model can take minutes to load
PROBE_TIMEOUT_S = 1.0
PROBE_EVERY_S = 0.2
LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_KEEP_BYTES = 1024 * 1024
MONITOR_EVERY_S = 0.5
# A worker's "health": it has no HTTP, so readiness is its port accepting connections.
WORKER_HEALTH = TCP
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def probe(url: str) -> bool:
    try:
        return requests.get(url, timeout=PROBE_TIMEOUT_S).status_code == 200
    except requests.RequestException:
        return False


def healthy(shard: Shard) -> bool:
    """Whether a started shard answers: an engine's health URL, a worker's port, or for a
    worker with neither its process (its gang is up when its leader's health answers)."""
    if shard.health == PROCESS:
        return process.alive(shard.pid, shard.started)
    if shard.health == WORKER_HEALTH:
        return workers.listening(shard.endpoint)
    return probe(shard.endpoint + shard.health)


class Supervisor:
    def __init__(
        self,
        cfg: AgentConfig,
        state_dir: Path,
        installer: Installer,
        weights: Weights,
        notify: Callable[[dict], None],
        start_timeout_s: float = START_TIMEOUT_S,
        traces: str = "",
    ):
        self.cfg = cfg
        self.traces = traces  # [tracing] endpoint: where engines that trace send spans
        self.dir = state_dir / "shards"
        self.installer = installer
        self.weights = weights
        self.notify = notify
        self.start_timeout_s = start_timeout_s
        self.shards: dict[str, Shard] = {}
        self._lock = threading.RLock()
        self._monitored = 0.0

    # -- files -----------------------------------------------------------------------------

    def _path(self, shard_id: str, suffix: str) -> Path:
        return self.dir / f"{shard_id}{suffix}"

    def _write_state(self, shard: Shard) -> None:
        tmp = self._path(shard.id, ".json.tmp")
        tmp.write_text(json.dumps(shard.state_file()) + "\n")
        tmp.replace(self._path(shard.id, ".json"))

    lock = property(lambda self: self._lock)

    def engine_key(self, shard_id: str) -> str:
        """The key a shard's engine was started with ("" if it has none)."""
        try:
            return self._path(shard_id, ".key").read_text().strip()
        except OSError:
            return ""

    def _write_key(self, shard_id: str, key: str) -> Path:
        path = self._path(shard_id, ".key")
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return path

    def _remove_files(self, shard_id: str, keep_log: bool) -> None:
        for suffix in (".json", ".key") if keep_log else (".json", ".key", ".log"):
            self._path(shard_id, suffix).unlink(missing_ok=True)

    # -- state changes ---------------------------------------------------------------------

    def _report(self, shard: Shard) -> None:
        with self._lock:
            body = shard.to_json()
        self.notify(body)

    def _set(self, shard: Shard, state: str) -> None:
        with self._lock:
            if shard.done or shard.stopping or shard.state == state:
                return
            shard.state = state
        _log.info(
            "shard_" + state,
            shard=shard.id,
            model=shard.model,
            pid=shard.pid,
            endpoint=shard.endpoint,
        )
        self._report(shard)

    def _finish(self, shard: Shard, state: str, reason: str = "", by_stop: bool = False) -> None:
        """The one way a shard ends: files removed, reported once, forgotten after that."""
        with self._lock:
            # A failure noticed while a stop kills the engine is the stop's doing.
            if shard.done or (shard.stopping and not by_stop):
                return
            shard.done = True
            shard.state, shard.reason, shard.rss = state, reason, 0
            self._remove_files(shard.id, keep_log=state == FAILED)
        if state == FAILED:
            _log.warning(
                "shard_failed",
                shard=shard.id,
                model=shard.model,
                reason=(reason.splitlines() or [""])[0],
            )
        else:
            _log.info("shard_" + state, shard=shard.id, model=shard.model)
        self._report(shard)

    # -- start -----------------------------------------------------------------------------

    def start(self, req: dict) -> None:
        """Handle `start_shard`: idempotent by id; the work happens in a thread."""
        shard_id = str(req.get("id", ""))
        if not _ID.match(shard_id):
            _log.warning("bad_start_shard", shard=shard_id, reason="id must be [A-Za-z0-9._-]")
            return
        with self._lock:
            current = self.shards.get(shard_id)
            if current is not None and not current.done:
                running = current
            else:
                running = None
                shard = Shard(
                    id=shard_id,
                    model=str(req.get("model", "")),
                    profile=str(req.get("profile", "")),
                    profile_name=str(req.get("profile_name") or ""),
                    engine=f"{req.get('engine', '')}-{req.get('engine_version', '')}",
                    started_at=time.time(),
                    role=str(req.get("role") or ""),
                    gpus=[str(g) for g in req.get("gpus_assigned") or []],
                )
                self.shards[shard_id] = shard
        if running is not None:
            self._report(running)
            return
        _log.info("shard_accepted", shard=shard_id, model=shard.model, engine=shard.engine)
        self._report(shard)
        threading.Thread(
            target=self._run_start, args=(shard, req), name=f"start-{shard_id}", daemon=True
        ).start()

    def _run_start(self, shard: Shard, req: dict) -> None:
        try:
            proc = self._launch(shard, req)
        except AgentError as e:
            self._finish(shard, FAILED, str(e))
            return
        except (OSError, ValueError, TypeError, KeyError) as e:
            self._finish(shard, FAILED, f"cannot start the engine: {e}")
            return
        if proc is None:
            return
        self._report(shard)  # still starting, now with pid, port and endpoint
        self._await_ready(shard, proc)

    def _launch(self, shard: Shard, req: dict) -> subprocess.Popen | None:
        rank = workers.rank_of(req)
        worker = req.get("role") == workers.ROLE
        if worker and rank is None:
            return self._launch_worker(shard, req)
        missing = [k for k in ("engine", "engine_version", "source") if not req.get(k)]
        if missing:
            raise AgentError(f"start_shard lacks {', '.join(missing)}")
        name, version = str(req["engine"]), str(req["engine_version"])
        source, sha256, mirror = str(req["source"]), str(req.get("sha256") or ""), req.get("mirror")
        shard.weights = entry_keys(source, sha256, mirror)
        model_path = self.weights.fetch(source, sha256, mirror)
        self._evict()
        self.installer.ensure(name, version)
        self.dir.mkdir(parents=True, exist_ok=True)
        fabric = workers.fabric_host(self.cfg) if rank is not None else ""
        with self._lock:
            if shard.stopping:
                return None
            # A vLLM worker serves nothing: no port, no key. Its leader takes a second
            # port, where its workers meet it.
            port = 0 if worker else self._free_port()
            if rank is not None and not worker:
                shard.master = f"{fabric}:{self._free_port(also=port)}"
            key_file = "" if worker else self._write_key(shard.id, str(req.get("key", "")))
            launch = launch_of(
                req, model_path=str(model_path), host=self.cfg.host, port=port,
                key_file=str(key_file), nnodes=rank.nnodes if rank else 1,
                node_rank=rank.rank if rank else 0,
                master=shard.master or (rank.master if rank else ""),
                fabric_address=fabric, fabric_interface=self.cfg.fabric_interface,
                traces=self.traces,
            )  # fmt: skip
            role = WORKER if worker else LEADER if launch.rpc or rank else ALONE
            cmd = self.installer.command(name, version, launch, role)
            endpoint = fabric if worker else f"http://{self.cfg.host}:{port}"
            proc = self._spawn(
                shard, cmd.argv, cmd.env, port, endpoint, self.installer.health(name, version, role)
            )
        _log.info(
            "shard_process_started", shard=shard.id, pid=proc.pid, port=port, command=cmd.argv[0]
        )
        return proc

    def _launch_worker(self, shard: Shard, req: dict) -> subprocess.Popen | None:
        """A worker holding part of a replica across nodes (llama.cpp's rpc-server), on the
        fabric address."""
        host = workers.fabric_host(self.cfg)
        name, version = str(req.get("engine", "")), str(req.get("engine_version", ""))
        self.installer.worker_binary(name, version)
        threads = int(req.get("threads") or 0) or os.cpu_count() or 1
        self.dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if shard.stopping:
                return None
            port = self._free_port()
            launch = Launch(model_path="", host=host, port=port, key_file="", context=0,
                            parallel=0, threads=threads)  # fmt: skip
            cmd = self.installer.command(name, version, launch, WORKER)
            health = self.installer.health(name, version, WORKER)
            proc = self._spawn(shard, cmd.argv, cmd.env, port, f"{host}:{port}", health)
        _log.info("shard_process_started", shard=shard.id, pid=proc.pid, port=port,
                  command=cmd.argv[0], role=workers.ROLE)  # fmt: skip
        return proc

    def _spawn(self, shard: Shard, argv: list[str], env: dict, port: int, endpoint: str,
               health: str) -> subprocess.Popen:  # fmt: skip
        """Start a shard's process in its own session, its output to its log file, and
        write down what finds it again after an agent restart. Under the lock."""
        log_path = self._path(shard.id, ".log")
        # O_APPEND: when the agent truncates an oversized log, the engine's next write
        # lands at the new end instead of leaving a hole of zeros before it.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o640)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=engine_env(env, shard.gpus),
                cwd=self.dir,
            )
        finally:
            os.close(fd)
        shard.proc, shard.pid, shard.port = proc, proc.pid, port
        shard.started = process.create_time(proc.pid)
        shard.endpoint, shard.health = endpoint, health
        shard.lines = deque(maxlen=max(1, self.cfg.log_lines))
        self._write_state(shard)
        return proc

    def _evict(self) -> None:
        """Keep the weights cache within agent.weights_max_bytes, sparing every entry a
        shard that is not done uses (a starting one's included)."""
        limit = self.cfg.weights_max_bytes
        if limit > 0:
            with self._lock:
                keep = {k for s in self.shards.values() if not s.done for k in s.weights}
            self.weights.evict(limit, keep)

    def _free_port(self, also: int = 0) -> int:
        """A port of agent.port_min-port_max no shard holds and none is bound to (`also`:
        one just taken, not yet recorded)."""
        used = {also} | {s.port for s in self.shards.values() if not s.done}
        used |= {int(s.master.rpartition(":")[2]) for s in self.shards.values()
                 if s.master and not s.done}  # fmt: skip
        for port in range(self.cfg.port_min, self.cfg.port_max + 1):
            if port not in used and process.port_free(port):
                return port
        raise AgentError(
            f"no free port in {self.cfg.port_min}-{self.cfg.port_max} "
            f"(agent.port_min / agent.port_max)"
        )

    def _await_ready(self, shard: Shard, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not shard.stopping:
            code = proc.poll()
            if code is not None:
                self._finish(
                    shard,
                    FAILED,
                    f"engine exited with status {code} before it was "
                    f"ready:\n{tail_lines(self._path(shard.id, '.log'))}",
                )
                return
            if healthy(shard):
                # Measured now, not at the next monitor pass: the heartbeat after "ready"
                # must already count what the engine holds, or placement sees the node
                # emptier than it is (and a loaded CI machine saw rss 0 there).
                shard.rss = process.rss(proc.pid)
                self._set(shard, READY)
                return
            if time.monotonic() > deadline:
                process.terminate(proc.pid, shard.started, STOP_GRACE_S, proc.wait)
                self._finish(
                    shard,
                    FAILED,
                    f"engine not ready after {self.start_timeout_s:.0f}"
                    f" s:\n{tail_lines(self._path(shard.id, '.log'))}",
                )
                return
            time.sleep(PROBE_EVERY_S)

    # -- stop ------------------------------------------------------------------------------

    def stop(self, shard_id: str) -> None:
        """Handle `stop_shard`; stopping an unknown shard answers `stopped` all the same."""
        with self._lock:
            shard = self.shards.get(shard_id)
            if shard is None or shard.done:
                gone = shard or Shard(id=shard_id, state=STOPPED, reason="not running")
                self.notify(gone.to_json())
                return
            if shard.stopping:
                return
            shard.stopping = True
        _log.info("shard_stopping", shard=shard_id, pid=shard.pid)
        threading.Thread(
            target=self._run_stop, args=(shard,), name=f"stop-{shard_id}", daemon=True
        ).start()

    def _run_stop(self, shard: Shard) -> None:
        # A shard still fetching weights has no process yet; stopping=True keeps one from
        # being started, because _launch checks it under the same lock.
        if shard.pid and shard.state == READY and shard.endpoint.startswith("http"):
            self._drain(shard)  # a worker (HOST:PORT) answers nothing itself
        if shard.pid:
            wait = shard.proc.wait if shard.proc is not None else None
            process.terminate(shard.pid, shard.started, STOP_GRACE_S, wait)
        self._finish(shard, STOPPED, by_stop=True)

    def _drain(self, shard: Shard) -> None:
        """Let a ready engine finish the requests it is answering before it is stopped,
        as its engine's definition says (llmgw.engines.Drain, drain.py)."""
        with self._lock:
            shard.state = DRAINING
        _log.info("shard_draining", shard=shard.id, model=shard.model)
        self._report(shard)
        try:
            key = self._path(shard.id, ".key").read_text().strip()
        except OSError:
            key = ""
        engine = engines.of(shard.engine)
        drain.drain(shard.id, engine.name if engine else None, shard.endpoint, key,
                    self.cfg.drain_timeout_s)  # fmt: skip

    # -- adoption --------------------------------------------------------------------------

    def adopt(self) -> None:
        """Take over the engines an earlier agent started, or report them gone once."""
        if not self.dir.is_dir():
            return
        for file in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(file.read_text())
                shard = Shard.from_state_file(data)
            except (OSError, ValueError, KeyError, TypeError) as e:
                _log.warning("bad_state_file", file=file, reason=e)
                file.unlink(missing_ok=True)
                continue
            is_alive = process.alive(shard.pid, shard.started)
            if is_alive and healthy(shard):
                shard.state = READY
                shard.lines = deque(
                    tail_lines(self._path(shard.id, ".log"), self.cfg.log_lines).splitlines(),
                    maxlen=max(1, self.cfg.log_lines),
                )
                shard.log_offset = self._log_size(shard.id)
                shard.rss = process.rss(shard.pid)
                self.shards[shard.id] = shard
                _log.info("shard_adopted", shard=shard.id, pid=shard.pid, endpoint=shard.endpoint)
                continue
            if is_alive:
                # Up but not answering: nobody would ever stop it if we let it go.
                process.signal_group(shard.pid, signal.SIGKILL)
            self.shards[shard.id] = shard
            self._finish(shard, FAILED, LOST)

    def _log_size(self, shard_id: str) -> int:
        try:
            return self._path(shard_id, ".log").stat().st_size
        except OSError:
            return 0

    # -- monitoring ------------------------------------------------------------------------

    def monitor(self, now: float | None = None) -> None:
        """Notice engines that died, keep RSS and log tails fresh. Called from the bus loop."""
        now = time.monotonic() if now is None else now
        if now - self._monitored < MONITOR_EVERY_S:
            return
        self._monitored = now
        with self._lock:
            live = (READY, DRAINING)
            watched = [s for s in self.shards.values()
                       if not s.done and not s.stopping and s.state in live]  # fmt: skip
        for shard in watched:
            if shard.proc is not None:
                code = shard.proc.poll()
                exited = code is not None
            else:
                code, exited = None, not process.alive(shard.pid, shard.started)
            self._pump_log(shard)
            if exited:
                status = f" with status {code}" if code is not None else ""
                tail = tail_lines(self._path(shard.id, ".log"))
                self._finish(shard, FAILED, f"engine exited{status}:\n{tail}")
                continue
            shard.rss = process.rss(shard.pid)

    def _pump_log(self, shard: Shard) -> None:
        """Feed new log lines to the in-memory tail; cut the file down when it grows big."""
        path = self._path(shard.id, ".log")
        size = self._log_size(shard.id)
        if size < shard.log_offset:
            shard.log_offset = 0  # truncated under us
        if size > shard.log_offset:
            try:
                with open(path, "rb") as f:
                    f.seek(max(shard.log_offset, size - 256 * 1024))
                    data = f.read(size - shard.log_offset)
            except OSError:
                return
            shard.log_offset += len(data)
            shard.lines.extend(data.decode(errors="replace").splitlines())
        if size > LOG_MAX_BYTES:
            # Keep the newest part: lines the engine writes meanwhile may be lost, which
            # is the price of a bounded file an engine keeps open.
            try:
                with open(path, "rb") as f:
                    f.seek(size - LOG_KEEP_BYTES)
                    keep = f.read()
                with open(path, "r+b") as f:
                    f.truncate(0)
                with open(path, "ab") as f:
                    f.write(b"[llmgw-agentd: log truncated]\n" + keep)
                shard.log_offset = self._log_size(shard.id)
            except OSError as e:
                _log.warning("log_truncate_failed", shard=shard.id, reason=e)

    # -- reporting -------------------------------------------------------------------------

    def report(self) -> list[dict]:
        with self._lock:
            return [s.to_json() for s in self.shards.values()]

    def forget(self, ids: set[str]) -> None:
        """Drop finished shards once a heartbeat has carried them."""
        with self._lock:
            for shard_id in ids:
                shard = self.shards.get(shard_id)
                if shard is not None and shard.done:
                    del self.shards[shard_id]

    def serving(self) -> list[tuple[Shard, str]]:
        """(shard, engine key) of each engine that answers requests now: ready or
        draining, over HTTP (a worker of a replica across nodes counts nothing)."""
        with self._lock:
            shards = [
                s for s in self.shards.values()
                if not s.done and s.pid and s.state in (READY, DRAINING)
                and s.endpoint.startswith("http")
            ]  # fmt: skip
        out = []
        for shard in shards:
            try:
                key = self._path(shard.id, ".key").read_text().strip()
            except OSError:
                key = ""
            out.append((shard, key))
        return out

    def set_tokens(self, shard_id: str, tokens: dict | None) -> None:
        with self._lock:
            shard = self.shards.get(shard_id)
            if shard is not None:
                shard.tokens = tokens

    def rss_total(self) -> int:
        with self._lock:
            return sum(s.rss for s in self.shards.values() if not s.done)

    def logs(self, shard_id: str) -> list[str]:
        """The newest lines of a shard's output, read up to now (not as of the last
        monitor pass: `llmgw logs` right after a start must show the start)."""
        with self._lock:
            shard = self.shards.get(shard_id)
        if shard is None:
            return []
        self._pump_log(shard)
        with self._lock:
            return list(shard.lines)
