"""The sockets around a Scheduler: one thread, one zmq poller.

Messages from agents go to Scheduler.handle; passes run every tick (or at once when
woken); commands queued by a pass go out on the ROUTER socket and the routing table
on the PUB socket, only while this scheduler leads.
"""

import time

import peewee
import zmq

from llmgw import bus, log, tracing
from llmgw.peers import drop_keypair, name_of, removed_since
from llmgw.states import MsgType
from llmgw.store import BusPeer, db_proxy, drop_connection
from llmgw.worker import Worker
from llmgw_scheduler.published import Published
from llmgw_scheduler.service import Scheduler

_log = log.get("llmgw.scheduler")

# How often the registered agents' and routers' keys are read from the store.
PEERS_S = 2.0


def lookup_peer(public_key: str) -> str | None:
    """A registered agent's or router's name (peers.name_of)."""
    return name_of(public_key, _log)


class Loop:
    """The sockets around a Scheduler."""

    def __init__(self, sched: Scheduler, keys, cfg):
        self.sched = sched
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.auth = bus.PeerAuthenticator(self.ctx, lookup=lookup_peer, logger=_log).start_for()
        self._said: set[tuple[str, str, str]] = set()  # (what, key owner, claimed), logged
        self._removals_read = 0  # the newest removal's audit entry read (refresh_peers)
        self.refresh_peers()
        # Read again on its own thread: on the loop's, a store that stopped answering held
        # the lock every admin request and every agent's message waits on.
        self.peers = Worker("bus_peers", self._read_peers, PEERS_S, db=db_proxy.obj,
                            logger=_log, backoff_max_s=PEERS_S)  # fmt: skip
        self.router = bus.serve(self.ctx, zmq.ROUTER, cfg.scheduler.bus, keys)
        self.pub = bus.serve(self.ctx, zmq.PUB, cfg.scheduler.publish, keys)
        self.published = Published()  # the last table sent, for the next diff
        self.running = True
        # A new keypair to serve with, set by the admin API (`keys rotate-scheduler
        # --finish`) and applied on this thread, which owns the sockets.
        self.rekey: tuple[bytes, bytes] | None = None

    def _apply_rekey(self, poller: zmq.Poller) -> None:
        """Serve with the new keypair: close both sockets and bind them again. Every
        peer reconnects; one that trusts the new key (scheduler.next.key) gets in."""
        keys, self.rekey = self.rekey, None
        poller.unregister(self.router)
        self.router.close(0)
        self.pub.close(0)
        self.router = _bind_again(self.ctx, zmq.ROUTER, self.cfg.scheduler.bus, keys)
        self.pub = _bind_again(self.ctx, zmq.PUB, self.cfg.scheduler.publish, keys)
        poller.register(self.router, zmq.POLLIN)
        _log.warning("scheduler_key_rotated", public_key=keys[0].decode()[:8])

    def refresh_peers(self) -> None:
        try:
            self._read_peers()
        except Exception as e:  # the store is down: keep the peers we know, reconnect later
            _log.debug("peers_not_refreshed", reason=str(e)[:200])
            drop_connection()

    def _read_peers(self) -> None:
        """Read the registered keys and the removals from the store without the
        scheduler's lock, then apply them under it. Only a node known before the read
        began may be forgotten (one that said hello meanwhile was registered after it),
        and a read that a revocation overtook is not applied to the ZAP handler."""
        s = self.sched
        with s.lock:
            known = set(s.inv.nodes)
        revocations = self.auth.revocations
        peers = list(BusPeer.select())
        removed, self._removals_read = removed_since(self._removals_read)
        if self.auth.revocations == revocations:
            self.auth.set_peers({p.public_key: p.name for p in peers})
        self._drop_revoked_keys(removed, {p.public_key for p in peers})
        agents = sorted(p.name for p in peers if p.kind == "agent")
        with s.lock:
            s.registered_nodes = agents
            # A node the store no longer has was removed (through the other scheduler, or
            # with `--store`): its key is refused from now on, so nothing it says brings
            # it back.
            for node in known - set(agents):
                s.forget_node(node)

    def _drop_revoked_keys(self, removed: list[tuple[str, str]], registered: set[str]) -> None:
        """Delete this machine's copy of every removed peer's keypair (install.md has the
        operator copy each keypair to both schedulers): the scheduler that handled the
        removal deleted only its own. Read from the audit log, so one that was down at
        the time drops it at its start."""
        curve = self.cfg.curve_dir()
        for name, public in removed:
            if public not in registered and drop_keypair(curve, name, public):
                _log.info("revoked_keypair_deleted", peer=name, public_key=public[:8])

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        s = self.sched
        self.peers.start()
        while self.running:
            if self.rekey is not None:
                self._apply_rekey(poller)
            events = dict(poller.poll(100))
            with s.lock:
                if events:
                    self._receive()
                now = time.monotonic()
                if now >= s.next_tick or s.wake:
                    s.wake = False
                    s.next_tick = now + self.cfg.scheduler.tick_s
                    try:
                        if s.leading():
                            self._pass()
                        else:
                            s.standby_tick()
                    except peewee.PeeweeException as e:
                        # The store blipped mid-pass: the next pass starts again from what
                        # the agents report (a start is only sent once its intent is kept).
                        _log.warning("pass_failed", reason=str(e)[:200])
                        drop_connection()
                # Checked again right before sending: a pass that outlived our lease sends
                # nothing (agents would refuse it anyway, by its epoch).
                if s.leading():
                    self._flush()
                    self._publish(now)
                else:
                    s.step_down()
            s.write_behind()  # store writes that need not hold the lock

    def _pass(self) -> None:
        """A leader's placement pass; while tracing is on, one that started, stopped or
        could not place something is a span, with what it decided (a pass that changed
        nothing, as most do, is none: a trace a second of nothing would bury them)."""
        s = self.sched
        if tracing.tracer is None:
            return s.tick()
        began = time.time_ns()
        s.tick()
        d = s.last_decisions
        if d is not None and (d.starts or d.stops or d.unplaceable):
            attrs = {
                "llmgw.starts": [f"{model}@{node}" for model, node, _ in d.starts],
                "llmgw.stops": list(d.stops),
                "llmgw.unplaceable": sorted(d.unplaceable),
                "llmgw.epoch": s.epoch,
            }
            tracing.done("llmgw.placement_pass", began, attrs)

    def _receive(self) -> None:
        while True:
            try:
                ident, frame = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except ValueError:
                continue  # not [identity, message]: nothing of ours
            sender = bus.sender_of(frame)
            try:
                msg = bus.decode(frame.bytes)
            except bus.BusError as e:
                _log.warning("bad_message", node=sender, reason=str(e))
                continue
            claimed = ident.bytes[:64].decode(errors="replace")
            if claimed != sender:
                self._refuse(ident.bytes, "identity_mismatch", sender, claimed,
                             f"this key is {sender}'s, but the agent calls itself {claimed}:"
                             f" copy {claimed}.key_secret from the control plane, or set"
                             f" [agent] name = \"{sender}\"")  # fmt: skip
                continue
            if not self.auth.allows(sender):
                # Removed (`llmgw nodes remove`) while connected: its handshake was before.
                self._refuse(ident.bytes, "peer_refused", sender, claimed,
                             "key removed from the control plane")  # fmt: skip
                continue
            self.sched.handle(sender, msg)

    def _refuse(self, ident: bytes, what: str, sender: str, claimed: str, reason: str) -> None:
        """Drop a peer's message, log why once per (key owner, claimed name), and tell the
        peer every time (it logs it once): a refused agent that hears nothing looks fine."""
        if (what, sender, claimed) not in self._said:
            self._said.add((what, sender, claimed))
            _log.warning(what, node=sender, claimed=claimed, reason=reason)
        try:
            self.router.send_multipart(
                [ident, bus.encode("refused", bus.SCHEDULER, {"reason": reason})], zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass  # gone already: nothing to tell

    def _flush(self) -> None:
        for node, data in self.sched.outbox:
            try:
                self.router.send_multipart([node.encode(), data], zmq.NOBLOCK)
            except zmq.ZMQError as e:
                _log.warning("send_failed", node=node, reason=str(e))
        self.sched.outbox.clear()

    def _publish(self, now: float) -> None:
        s = self.sched
        if not s.settled(s.clock()):
            return  # an empty table from a scheduler that just started would stop routers
        if s.routes_dirty or now >= s.next_snapshot:
            if s.routes_dirty:
                s.seq += 1
            s.routes_dirty = False
            s.next_snapshot = now + self.cfg.scheduler.snapshot_s
            body = s.routes()
            diff = self.published.publish(body, s.epoch)
            # The diff first: a router in step applies it at once. Routers that hold no
            # table of this lineage (joined late, missed a diff, older ones) take the
            # whole table; the others are not subscribed to it (published.py).
            if diff is not None:
                self.pub.send(bus.encode(MsgType.ROUTES_DIFF, "scheduler", diff, s.epoch))
            self.pub.send(bus.encode(MsgType.ROUTES, "scheduler", body, s.epoch))

    def close(self) -> None:
        self.peers.stop()
        self.router.close(0)
        self.pub.close(0)
        self.auth.stop()
        self.ctx.term()


def _bind_again(ctx: zmq.Context, kind: int, bind: str, keys) -> zmq.Socket:
    """Bind an address just released: libzmq closes sockets on its own thread, so the
    port can be busy for a moment."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return bus.serve(ctx, kind, bind, keys)
        except bus.BusError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
