"""Many agents and routers, simulated on real sockets, around the real llmgw-scheduler.

For fleet scale (bench/fleet_scale.py, tests/system/test_fleet_scale.py): a few child
processes each play many agents or routers. A simulated agent is a real CURVE DEALER
with its own keypair registered in the store; it says hello with plausible resources
(every fourth node has eight GPUs), sends the heartbeat on the agent's schedule with the
agent's body, reports each shard's state at once, and answers `start_shard` with a
loopback port that answers HTTP (its readiness is a real GET of it) and `stop_shard` by
closing it. A simulated router is the router's own `Feed` (SUB to the table, DEALER
for wants and activity) on a RoutingTable, reporting activity as a router with traffic
does. Nothing runs an engine: what is measured is the control plane.

The parent talks to each child over a pipe: `ask(what)` gathers every child's answer.
"""

import asyncio
import heapq
import json
import multiprocessing
import os
import queue
import threading
import time
from collections import deque
from pathlib import Path

import zmq

from llmgw import __version__, bus

GiB = 1 << 30
ENGINE = "fake"  # the scheduler's [[agent.engines]] name; agents report "fake-1"
GPU_EVERY = 4  # every fourth node has GPUs
GPUS_PER_NODE = 8
GPU_MEMORY = 80 * GiB
NODE_MEMORY = 64 * GiB


def keypairs(n: int) -> list[tuple[bytes, bytes]]:
    return [zmq.curve_keypair() for _ in range(n)]


def register(store_url: str, peers: list[tuple[str, str, bytes]]) -> None:
    """Register (name, kind, public key) rows in one transaction: `llmgw nodes add`
    writes the same row one process at a time (and a key file that no simulated peer
    needs: they hold their keys in memory)."""
    from llmgw.store import BusPeer, migrate, open_store

    db = open_store(store_url)
    migrate(db)
    now = time.time()
    rows = [{"name": n, "kind": k, "public_key": p.decode(), "created_at": now}
            for n, k, p in peers]  # fmt: skip
    with db.atomic():
        for i in range(0, len(rows), 500):
            BusPeer.insert_many(rows[i : i + 500]).execute()
    db.close()


# -- HTTP ports that answer, many per process ------------------------------------------


class Ports:
    """One asyncio loop on its own thread, holding a listening port per shard."""

    ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n"
              b"Connection: close\r\n\r\n{\"status\":\"ok\"}")  # fmt: skip

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.servers: dict[int, asyncio.AbstractServer] = {}
        self.ready: queue.SimpleQueue = queue.SimpleQueue()  # (token, ok, error) of each check
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def _serve(self, reader, writer) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(self.ANSWER)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _open(self) -> int:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        self.servers[port] = server
        return port

    async def _check(self, port: int, token) -> None:
        """As an agent's readiness probe: GET until it answers, for a while."""
        ok, error = False, ""
        for _ in range(50):
            try:
                async with asyncio.timeout(2.0):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                    ok = (await reader.readline()).startswith(b"HTTP/1.1 200")
                    writer.close()
            except Exception as e:  # any failure is a try that did not answer
                error = repr(e)
            if ok:
                break
            await asyncio.sleep(0.2)
        self.ready.put((token, ok, error))

    def open(self) -> int:
        return asyncio.run_coroutine_threadsafe(self._open(), self.loop).result(10)

    def check(self, port: int, token) -> None:
        """GET /health on `port`; (token, ok, error) lands in `ready`."""
        asyncio.run_coroutine_threadsafe(self._check(port, token), self.loop)

    def close(self, port: int) -> None:
        server = self.servers.pop(port, None)
        if server is not None:
            self.loop.call_soon_threadsafe(server.close)


# -- agents --------------------------------------------------------------------------------


def gpus_of(index: int) -> list[dict]:
    if index % GPU_EVERY:
        return []
    return [{"index": g, "uuid": f"GPU-{index:06d}-{g}", "name": "NVIDIA A100-SXM4-80GB",
             "memory_total": GPU_MEMORY, "memory_free": GPU_MEMORY, "healthy": True,
             "health": "", "mig": "Disabled"} for g in range(GPUS_PER_NODE)]  # fmt: skip


class Agent:
    def __init__(self, index: int, name: str, sock: zmq.Socket):
        self.index, self.name, self.sock = index, name, sock
        self.gpus = gpus_of(index)
        self.shards: dict[str, dict] = {}
        self.finished: list[dict] = []  # stopped: in the next heartbeat, then forgotten
        self.epoch = 0
        self.hello_at: float | None = None
        self.sends: deque = deque(maxlen=8)  # when each of the last heartbeats went
        self.starts = self.stops = self.refused = 0

    def body(self) -> dict:
        used = sum(s["rss"] for s in self.shards.values())
        held = {u for s in self.shards.values() for u in s.get("gpus", ())}
        gpus = [{**g, "memory_free": g["memory_free"] // 8 if g["uuid"] in held else
                 g["memory_free"]} for g in self.gpus]  # fmt: skip
        shards = [*self.shards.values(), *self.finished]
        self.finished = []
        return {
            "node": self.name, "version": __version__,
            "resources": {"cpus": 32, "memory_total": NODE_MEMORY,
                          "memory_available": max(0, NODE_MEMORY - used), "gpus": gpus,
                          "disk_total": 2000 * GiB, "disk_free": 1500 * GiB},
            "engines": {f"{ENGINE}-1": {"state": "installed", "reason": ""}},
            "installable": {"llama.cpp": {"accelerators": ["cpu"]}},
            "shards": shards, "fetching": [], "weights": [],
            "topology": {"matrix": None, "infiniband": [], "health": [],
                         "fabric": {"label": "", "address": "", "interface": ""}},
        }  # fmt: skip

    def send(self, kind: str, body: dict) -> bool:
        try:
            self.sock.send(bus.encode(kind, self.name, body, self.epoch), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False


class Agents:
    """Agents of one child process: one poller over their DEALERs and the parent's pipe."""

    def __init__(self, spec: dict):
        self.heartbeat_s = spec["heartbeat_s"]
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.MAX_SOCKETS, 65536)
        self.ports = Ports()
        server_public = spec["server_public"]
        self.agents: list[Agent] = []
        for index, name, keys in spec["agents"]:
            sock = bus.connect(self.ctx, zmq.DEALER, [spec["bus"]], keys, server_public, name)
            self.agents.append(Agent(index, name, sock))
        self.by_sock = {a.sock: a for a in self.agents}
        # (when, n, agent): heartbeats due; n keeps the heap from comparing agents
        self.due: list = []
        self.unknown: dict[str, int] = {}

    def _command(self, a: Agent, data: bytes) -> None:
        msg = json.loads(data)
        kind, body = msg.get("type"), msg.get("body") or {}
        a.epoch = max(a.epoch, int(msg.get("epoch") or 0))
        if kind == "start_shard":
            rid = body["id"]
            if rid in a.shards:
                a.send("shard_status", {"node": a.name, "shard": a.shards[rid]})
                return
            a.starts += 1
            port = self.ports.open()
            shard = {"id": rid, "model": body.get("model", ""), "profile": body.get("profile", ""),
                     "state": "starting", "endpoint": f"http://127.0.0.1:{port}", "port": port,
                     "pid": 0, "rss": 0, "started_at": time.time(), "reason": "",
                     "gpus": list(body.get("gpus_assigned") or ())}  # fmt: skip
            if body.get("profile_name"):
                shard["profile_name"] = body["profile_name"]
            a.shards[rid] = shard
            a.send("shard_status", {"node": a.name, "shard": shard})
            self.ports.check(port, (a.index, rid))
        elif kind == "stop_shard":
            rid = str(body.get("id", ""))
            shard = a.shards.pop(rid, None) or {"id": rid, "model": "", "endpoint": "",
                                                "port": 0, "pid": 0, "rss": 0}  # fmt: skip
            a.stops += 1
            self.ports.close(shard.get("port", 0))
            shard = {**shard, "state": "stopped", "reason": "stopped on request", "pid": 0}
            a.finished.append(shard)
            a.send("shard_status", {"node": a.name, "shard": shard})
        elif kind == "refused":
            a.refused += 1
        elif kind != "leader":
            self.unknown[kind] = self.unknown.get(kind, 0) + 1

    def _became_ready(self) -> None:
        by_index = {a.index: a for a in self.agents}
        while True:
            try:
                (index, rid), ok, error = self.ports.ready.get_nowait()
            except queue.Empty:
                return
            a = by_index[index]
            shard = a.shards.get(rid)
            if shard is None or shard["state"] != "starting":
                continue
            shard.update(state="ready" if ok else "failed", pid=os.getpid(),
                         rss=2 * GiB if ok else 0,
                         reason="" if ok else f"health check failed: {error}")  # fmt: skip
            a.send("shard_status", {"node": a.name, "shard": shard})

    def _beats(self, now: float) -> None:
        for a in self.agents:
            if a.hello_at is None and a.send("hello", a.body()):
                a.hello_at = now
                # Agents start at different moments: spread their heartbeats alike.
                first = now + self.heartbeat_s * (a.index % 97) / 97
                heapq.heappush(self.due, (first, a.index, a))
        while self.due and self.due[0][0] <= now:
            when, _, a = heapq.heappop(self.due)
            sent = time.time()  # before: the scheduler may take it before send() returns
            if a.send("heartbeat", a.body()):
                a.sends.append(sent)
            heapq.heappush(self.due, (when + self.heartbeat_s, a.index, a))

    def answer(self, what: str):
        if what == "agents":
            return {a.name: {"hello_at": a.hello_at, "sends": list(a.sends), "starts": a.starts,
                             "stops": a.stops, "refused": a.refused,
                             "ready": sum(s["state"] == "ready" for s in a.shards.values())}
                    for a in self.agents}  # fmt: skip
        if what == "unknown":
            return dict(self.unknown)
        if what == "starting":  # shards not ready 30 s after their start
            now = time.time()
            return {f"{a.name}/{rid}": s for a in self.agents for rid, s in a.shards.items()
                    if s["state"] == "starting" and now - s["started_at"] > 30}  # fmt: skip
        return None

    def run(self, conn) -> None:
        poller = zmq.Poller()
        for a in self.agents:
            poller.register(a.sock, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        hellos_pending = True
        while True:
            events = dict(poller.poll(20 if hellos_pending else 50))
            for sock in events:
                if sock == conn.fileno():
                    what = conn.recv()
                    if what == "stop":
                        conn.send(None)
                        return
                    conn.send(self.answer(what))
                    continue
                a = self.by_sock[sock]
                while True:
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._command(a, data)
            self._became_ready()
            now = time.time()
            if hellos_pending:
                hellos_pending = any(a.hello_at is None for a in self.agents)
            self._beats(now)


def _agents_main(conn, spec) -> None:
    sim = Agents(spec)
    try:
        sim.run(conn)
    finally:
        for a in sim.agents:
            a.sock.close(0)
        sim.ctx.term()


# -- routers -------------------------------------------------------------------------------


class Routers:
    """Routers of one child process: each the router's own Feed on a RoutingTable."""

    def __init__(self, spec: dict):
        from llmgw_router.feed import Feed
        from llmgw_router.routing import RoutingTable

        self.lock = threading.Lock()
        self.feeds = []
        self.state: dict[str, dict] = {}
        for name, keys in spec["routers"]:
            table = RoutingTable(fed=True)
            feed = Feed(table, [spec["pub"]], keys, spec["server_public"],
                        bus_endpoints=[spec["bus"]], name=name)  # fmt: skip
            feed.apply = self._recorder(name, table)
            self.state[name] = {"applied": 0, "endpoints": 0, "seen": {}}
            self.feeds.append(feed)
        self.by_name = {feed.name: feed for feed in self.feeds}
        for feed in self.feeds:
            feed.start()

    def _recorder(self, name: str, table):
        def apply(eps, known):
            table.replace(eps, known)
            now = time.time()
            with self.lock:
                st = self.state[name]
                st["applied"] += 1
                st["endpoints"] = len(eps)
                seen = st["seen"]
                for model in known:
                    if model not in seen:
                        seen[model] = now

        return apply

    def answer(self, what: str):
        with self.lock:
            if what == "routers":
                # on_diffs: holding a table it follows by diffs, not sent whole ones
                return {n: {"applied": s["applied"], "endpoints": s["endpoints"],
                            "models": len(s["seen"]),
                            "on_diffs": not self.by_name[n]._whole_wanted,
                            **self.by_name[n].applied}
                        for n, s in self.state.items()}  # fmt: skip
            if what.startswith("seen "):
                model = what.split(" ", 1)[1]
                return {n: s["seen"].get(model) for n, s in self.state.items()}
        return None

    def run(self, conn) -> None:
        while True:
            if conn.poll(1.0):
                what = conn.recv()
                if what == "stop":
                    conn.send(None)
                    return
                conn.send(self.answer(what))
            # Traffic, as far as the schedulers can tell: a model in use on each router.
            now = time.time()
            for feed in self.feeds:
                feed.used("model-00000", now)


def _routers_main(conn, spec) -> None:
    sim = Routers(spec)
    try:
        sim.run(conn)
    finally:
        for feed in sim.feeds:
            feed.stop()


# -- the parent's side ---------------------------------------------------------------------


class Sim:
    """Child processes playing `agents` and `routers` (lists of (name, keys)) against the
    scheduler at `bus` / `pub`."""

    def __init__(self, bus_ep: str, pub_ep: str, server_public: str, heartbeat_s: float):
        self.bus, self.pub, self.server_public = bus_ep, pub_ep, server_public
        self.heartbeat_s = heartbeat_s
        self.children: list[tuple[multiprocessing.Process, object]] = []
        self._ctx = multiprocessing.get_context("spawn")

    def _spawn(self, target, spec: dict) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=target, args=(child, spec), daemon=True)
        proc.start()
        self.children.append((proc, parent))

    def start_agents(self, agents: list[tuple[int, str, tuple]], processes: int) -> None:
        for p in range(processes):
            mine = agents[p::processes]
            if mine:
                self._spawn(_agents_main, {"agents": mine, "bus": self.bus,
                                           "server_public": self.server_public,
                                           "heartbeat_s": self.heartbeat_s})  # fmt: skip

    def start_routers(self, routers: list[tuple[str, tuple]]) -> None:
        self._spawn(_routers_main, {"routers": routers, "bus": self.bus, "pub": self.pub,
                                    "server_public": self.server_public})  # fmt: skip

    def ask(self, what: str) -> dict:
        """Every child's answer to `what`, merged (children that do not know say None)."""
        out: dict = {}
        for _, conn in self.children:
            conn.send(what)
        for _, conn in self.children:
            got = conn.recv()
            if got:
                out.update(got)
        return out

    def stop(self) -> None:
        for _, conn in self.children:
            try:
                conn.send("stop")
                if conn.poll(10):
                    conn.recv()
            except (OSError, EOFError):
                pass
        for proc, _ in self.children:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        self.children = []


def pids(sim: Sim) -> list[int]:
    return [proc.pid for proc, _ in sim.children]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
