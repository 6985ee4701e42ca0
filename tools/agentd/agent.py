"""The agent's bus loop: report this node to every scheduler and carry out its commands.

One DEALER per scheduler, not one connected to all: a DEALER deals messages round-robin
across its peers, and a standby scheduler must hear every heartbeat too. Sends never
block (a scheduler that is away must not stall the loop); what is lost meanwhile is made
good by the next heartbeat, which carries the whole state.

Everything slow — fetching weights, installing engines, waiting for readiness, stopping
with grace — runs in threads that post events to a queue; only this loop's thread
touches the sockets.
"""

import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from llmgw import __version__, bus, log
from llmgw.config import Config
from llmgw.states import MsgType
from llmgw_agentd import metrics
from llmgw_agentd.adapters import Loader
from llmgw_agentd.counters import Counters
from llmgw_agentd.engines import FAILED, Installer
from llmgw_agentd.fabric import Tester
from llmgw_agentd.resources import Resources
from llmgw_agentd.supervisor import FAILED as SHARD_FAILED
from llmgw_agentd.supervisor import START_TIMEOUT_S, STOPPED, Supervisor
from llmgw_agentd.topology import Probe
from llmgw_agentd.weights import Weights, remove_partial

_log = log.get("llmgw.agentd")

POLL_MS = 100
# libzmq gives up for good on a scheduler that refused our key (ZAP 400): an agent started
# before `llmgw nodes add` registered it would never get in. A fresh socket tries again.
RECONNECT_S = 5.0
CONNECT_GRACE_S = 2.0


def _ca(cfg: Config):
    """What the mirror's https is verified against: the cluster CA where this node has
    it (<config_dir>/pki/ca.crt), else the system's CAs."""
    ca = cfg.ca_file()
    return str(ca) if ca.exists() else True


def read_epoch(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def write_epoch(path: Path, epoch: int) -> None:
    """Durably: written beside, synced, renamed, so a crash leaves the old or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Link:
    """One scheduler: its socket and whether it has had our hello since it was last away."""

    endpoint: str
    sock: zmq.Socket
    greeted: bool = False
    reachable: bool | None = None  # None: not yet known (the handshake takes a moment)
    away_since: float = field(default_factory=time.monotonic)
    handshakes: bus.Handshakes | None = None
    told: str = ""  # the reason the scheduler last gave for refusing us, once logged
    server_key: str = ""  # the scheduler public key this link trusts now
    tried_other: bool = False  # since the last accepted handshake

    def refused(self) -> bool:
        return self.handshakes is not None and self.handshakes.refused is not None


class Agent:
    def __init__(self, cfg: Config, keys: tuple[bytes, bytes], scheduler_public: str):
        self.cfg = cfg
        self.name = cfg.agent.name or socket.gethostname()
        self.keys = keys
        self.scheduler_public = scheduler_public
        state_dir = Path(cfg.paths.state_dir)
        remove_partial(state_dir)
        self.events: queue.SimpleQueue[tuple[str, dict]] = queue.SimpleQueue()
        self.probe = Probe(cfg.agent)
        self.resources = Resources(cfg.agent, disk=state_dir, probe=self.probe)
        self.fabric = Tester(cfg.agent, self.name, lambda kind, body: self.events.put((kind, body)))
        self.installer = Installer(
            cfg.agent, state_dir, lambda: bool(self.resources.gpus()), self._on_install
        )
        self.supervisor = Supervisor(
            cfg.agent, state_dir, self.installer, Weights(state_dir, verify=_ca(cfg)),
            self._on_shard,
            start_timeout_s=getattr(cfg.agent, "start_timeout_s", START_TIMEOUT_S),
            traces=cfg.tracing.endpoint,
        )  # fmt: skip
        self.counters = Counters(self.supervisor, cfg.agent.heartbeat_s)
        self.adapters = Loader(self.supervisor, self.supervisor.weights)
        # The newest leader epoch seen, kept on disk: a restarted agent must still refuse
        # a deposed leader.
        self.epoch_file = state_dir / "epoch"
        self.epoch = read_epoch(self.epoch_file)
        metrics.EPOCH.set(self.epoch)
        self.links: list[Link] = []
        self._next_beat = 0.0
        self._unsupported: set[str] = set()

    # -- events from worker threads --------------------------------------------------------

    def _on_shard(self, shard: dict) -> None:
        self.events.put((MsgType.SHARD_STATUS, {"node": self.name, "shard": shard}))

    def _on_install(self, engine_id: str, state: str, reason: str) -> None:
        # The whole entry a heartbeat would carry: what the build can use, its retry.
        body = {"node": self.name, "engine": engine_id,
                **self.installer.entry(engine_id, state, reason)}  # fmt: skip
        self.events.put((MsgType.INSTALL_STATUS, body))

    # -- sending ---------------------------------------------------------------------------

    def state_body(self) -> dict:
        shards = self.supervisor.report()
        return {
            "node": self.name,
            "version": __version__,
            "resources": self.resources.snapshot(self.supervisor.rss_total()),
            "engines": self.installer.report(),
            "installable": self.installer.installable(),
            "shards": shards,
            "fetching": self.supervisor.weights.fetching(),
            "weights": self.supervisor.weights.cached(),
            "topology": self.probe.report(),
        }

    def _send(self, link: Link, kind: str, body: dict) -> bool:
        try:
            link.sock.send(bus.encode(kind, self.name, body, self.epoch), zmq.NOBLOCK)
            ok = True
        except zmq.Again:
            ok = False  # no connection up (immediate=True): the scheduler is away
        # Once per change: a scheduler away for a day must not write a line a second.
        if ok and link.reachable is not True:
            _log.info("scheduler_reachable", endpoint=link.endpoint)
            link.reachable = True
        elif not ok and link.refused():
            link.reachable = False  # it is there, and said no: _watch said so once
        elif not ok and link.reachable is True:
            _log.warning("scheduler_unreachable", endpoint=link.endpoint)
            link.reachable, link.away_since = False, time.monotonic()
        elif not ok and link.reachable is None:
            # Every start would otherwise warn about the first hello, sent before the
            # CURVE handshake completes.
            if time.monotonic() - link.away_since > CONNECT_GRACE_S:
                _log.warning("scheduler_unreachable", endpoint=link.endpoint)
                link.reachable = False
        return ok

    def _send_state(self, now: float) -> None:
        """Heartbeat when due; hello to any scheduler that has not had one since it was away.

        A scheduler that restarted learns everything from the hello; one we could not
        reach at start gets it as soon as the connection is up, not a heartbeat later.
        """
        due = now >= self._next_beat
        pending = [link for link in self.links if due or not link.greeted]
        if not pending:
            return
        body = self.state_body()
        for link in pending:
            link.greeted = self._send(link, "heartbeat" if link.greeted else "hello", body)
        if due:
            self._next_beat = now + self.cfg.agent.heartbeat_s
            metrics.update(body)
            # A stopped or failed shard is reported in one heartbeat, then forgotten.
            self.supervisor.forget(
                {s["id"] for s in body["shards"] if s["state"] in (STOPPED, SHARD_FAILED)}
            )

    def _drain_events(self) -> None:
        while True:
            try:
                kind, body = self.events.get_nowait()
            except queue.Empty:
                return
            for link in self.links:
                self._send(link, kind, body)

    # -- receiving -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Say once per change that a scheduler refuses our key: it is there, so calling
        it unreachable would send the operator to the network instead of the keys."""
        for link in self.links:
            news = link.handshakes.news() if link.handshakes else None
            if news is None:
                continue
            what, reason = news
            if what == "refused":
                if reason != bus.NOT_REGISTERED and not link.tried_other:
                    link.tried_other = True
                    if self._try_other_key(link):
                        continue  # a rotation: the scheduler serves with its next key
                if reason == bus.NOT_REGISTERED:
                    reason += f" ({bus.copy_hint(self.name)})"
                _log.warning("scheduler_refused", endpoint=link.endpoint, reason=reason)
                link.reachable = False
            else:
                link.told, link.tried_other = "", False

    def handle(self, data: bytes, link: Link | None = None) -> None:
        try:
            msg = bus.decode(data)
        except bus.BusError as e:
            _log.warning("bad_message", reason=e)
            return
        if msg["type"] == "refused" and msg.get("from") == bus.SCHEDULER:
            # The scheduler will not hear us (our key is another node's, or was removed):
            # it says so on every message; we say it once.
            reason = str(msg["body"].get("reason", ""))[:300]
            if link is not None and reason != link.told:
                link.told = reason
                _log.warning("scheduler_refused", endpoint=link.endpoint, reason=reason)
            return
        epoch = msg.get("epoch", 0)
        if not isinstance(epoch, int):
            epoch = 0
        kind, body = msg["type"], msg["body"]
        if epoch < self.epoch:
            # A scheduler that lost its lease may not know it yet; its word is void, and
            # it is told so (it steps down on hearing of a newer epoch).
            _log.warning("stale_command", type=kind, epoch=epoch, newest=self.epoch)
            metrics.REFUSED.labels("stale_epoch").inc()
            if link is not None:
                reason = f"epoch {epoch} is older than epoch {self.epoch}, which leads now"
                self._send(link, "refused", {"type": kind, "epoch": epoch, "reason": reason})
            return
        if epoch > self.epoch:
            write_epoch(self.epoch_file, epoch)  # before acting on the new leader's word
            _log.info("leader_epoch", epoch=epoch, was=self.epoch)
            self.epoch = epoch
            metrics.EPOCH.set(epoch)
        if kind == "leader":
            return  # the epoch is all it carries
        # Each accepted command with its epoch: what shows, after a failover, that no
        # command of the old leader was obeyed once the new one had spoken.
        _log.debug("command_accepted", type=kind, epoch=epoch)
        if kind == "start_shard":
            self.supervisor.start(body)
        elif kind == "stop_shard":
            self.supervisor.stop(str(body.get("id", "")))
        elif kind == "install_engine":
            self._install(str(body.get("engine", "")), str(body.get("version", "")))
        elif kind == "get_logs":
            self._logs(body)
        elif kind == MsgType.SET_ADAPTERS:
            self.adapters.set(body)
        elif kind in (MsgType.FABRIC_LISTEN, MsgType.FABRIC_TEST):
            self.fabric.handle(kind, body)
        elif kind not in self._unsupported:
            self._unsupported.add(kind)
            _log.warning("unsupported_command", type=kind)

    def _logs(self, body: dict) -> None:
        """Answer `get_logs` with the tail of a shard's output (`llmgw logs`)."""
        shard_id = str(body.get("id", ""))
        lines = self.supervisor.logs(shard_id)
        try:
            n = max(1, min(int(body.get("lines", 100)), self.cfg.agent.log_lines))
        except (TypeError, ValueError):
            n = 100
        known = shard_id in self.supervisor.shards
        reply = {
            "request": body.get("request", ""),
            "id": shard_id,
            "node": self.name,
            "lines": lines[-n:],
            "error": "" if known else f"no shard {shard_id} here",
        }
        for link in self.links:
            self._send(link, "logs", reply)

    def _install(self, name: str, version: str) -> None:
        if not name or not version or not self.installer.known(name, version):
            self._on_install(
                f"{name}-{version}", FAILED, f"engine {name}-{version} is not known on this node"
            )
            return
        self.installer.install_async(name, version)

    # -- the loop --------------------------------------------------------------------------

    def _connect(self, endpoint: str, server_key: str) -> zmq.Socket:
        sock = bus.connect(
            self.ctx, zmq.DEALER, [endpoint], self.keys, server_key, identity=self.name
        )
        self.poller.register(sock, zmq.POLLIN)
        return sock

    def _try_other_key(self, link: Link) -> bool:
        """Handshakes keep failing: if scheduler.next.key is here (a key rotation), try
        it, and back the other way if the scheduler has not rotated yet. True if a
        different key is now being tried."""
        other = bus.other_key(self.cfg.curve_dir(), link.server_key)
        if other is None or other == link.server_key:
            return False
        link.server_key = other
        self._relink(link, time.monotonic())
        link.handshakes.forget()  # count the new key's failures afresh
        _log.info("scheduler_key_tried", endpoint=link.endpoint, public_key=other[:8])
        return True

    def _relink(self, link: Link, now: float) -> None:
        self.poller.unregister(link.sock)
        link.sock.close(0)
        link.sock = self._connect(link.endpoint, link.server_key)
        link.handshakes.follow(link.sock)
        link.away_since = now

    def _reconnect(self, now: float) -> None:
        for link in self.links:
            if link.reachable is False and now - link.away_since > RECONNECT_S:
                if link.refused():  # keys copied since: each retry tries the other one
                    link.server_key = (
                        bus.other_key(self.cfg.curve_dir(), link.server_key) or link.server_key
                    )
                self._relink(link, now)
                _log.debug("scheduler_reconnect", endpoint=link.endpoint)

    def run(self, stop: threading.Event) -> None:
        """Until `stop` is set. Engines keep running after this returns, by design."""
        ctx = self.ctx = zmq.Context()
        poller = self.poller = zmq.Poller()
        for endpoint in self.cfg.agent.schedulers:
            sock = self._connect(endpoint, self.scheduler_public)
            self.links.append(
                Link(
                    endpoint,
                    sock,
                    handshakes=bus.Handshakes(sock),
                    server_key=self.scheduler_public,
                )  # fmt: skip
            )
        self.supervisor.adopt()
        _log.info(
            "started",
            node=self.name,
            schedulers=",".join(self.cfg.agent.schedulers),
            shards=len(self.supervisor.shards),
        )
        self.counters.start()
        try:
            while not stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    link = next((lk for lk in self.links if lk.sock is sock), None)
                    while True:
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.handle(frames[-1], link)
                self._watch()
                self.installer.retry_due()
                self.supervisor.monitor()
                self._drain_events()
                now = time.monotonic()
                self._send_state(now)
                self._reconnect(now)
        finally:
            self.counters.stop()
            for link in self.links:
                link.handshakes.close()
                link.sock.close(0)
            ctx.term()
        _log.info("exiting", node=self.name, engines_left_running=len(self.supervisor.shards))
