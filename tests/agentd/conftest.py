"""A fake scheduler (a real CURVE ROUTER socket) and real llmgw-agentd processes."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import zmq

from llmgw import bus
from tests.helpers import ROOT, Proc, eventually, free_port, free_range

NODE = "node-a"
MEMORY = 8 * 1024**3
FAKE_ENGINE = [sys.executable, str(ROOT / "tests" / "fake_engine.py"),
               "--port", "{port}", "--key-file", "{key_file}"]  # fmt: skip


class RecordingAuthenticator(bus.PeerAuthenticator):
    """Lets in registered keys like the scheduler's, and remembers who knocked."""

    def __init__(self, context):
        super().__init__(context)
        self.knocked: list[str] = []

    def callback(self, domain, key: bytes) -> bool:
        self.knocked.append(key.decode())
        return super().callback(domain, key)


class FakeScheduler:
    """The scheduler's end of the bus: receives from agents and sends them commands."""

    def __init__(self, curve_dir: Path):
        self.ctx = zmq.Context()
        self.auth = RecordingAuthenticator(self.ctx).start_for()
        self.peers: dict[str, str] = {}
        bus.create_keypair(curve_dir, bus.SCHEDULER)
        self.port = free_port()
        self.sock = bus.serve(self.ctx, zmq.ROUTER, f"tcp://127.0.0.1:{self.port}",
                              bus.load_keypair(curve_dir, bus.SCHEDULER))  # fmt: skip
        self.received: list[dict] = []  # each message with "sender": the CURVE name

    def register(self, name: str, public: str) -> None:
        self.peers[public] = name
        self.auth.set_peers(self.peers)

    def pump(self) -> list[dict]:
        while self.sock.poll(0):
            identity, frame = self.sock.recv_multipart(copy=False)
            msg = bus.decode(frame.bytes)
            msg["sender"] = bus.sender_of(frame)
            self.received.append(msg)
        return self.received

    def messages(self, kind: str) -> list[dict]:
        return [m for m in self.pump() if m["type"] == kind]

    def shard_states(self, shard_id: str) -> list[str]:
        return [m["body"]["shard"]["state"] for m in self.messages("shard_status")
                if m["body"]["shard"]["id"] == shard_id]  # fmt: skip

    def wait_shard(self, shard_id: str, state: str, timeout: float = 15.0) -> dict:
        """The first shard_status for this shard in this state."""

        def found():
            for m in self.messages("shard_status"):
                shard = m["body"]["shard"]
                if shard["id"] == shard_id and shard["state"] == state:
                    return shard
            return None

        return eventually(found, timeout, what=f"shard {shard_id} {state}")

    def wait(self, kind: str, cond=lambda body: True, timeout: float = 15.0) -> dict:
        def found():
            return next((m["body"] for m in self.messages(kind) if cond(m["body"])), None)

        return eventually(found, timeout, what=f"a {kind} message")

    def send(self, node: str, kind: str, body: dict, epoch: int = 0) -> None:
        self.sock.send_multipart([node.encode(), bus.encode(kind, bus.SCHEDULER, body, epoch)])

    def forget(self) -> None:
        """Drop what was received so far: the next wait sees only new messages."""
        self.pump()
        self.received.clear()

    def close(self) -> None:
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


def start_body(shard_id: str, source: str, engine: str = "fake", **kw) -> dict:
    return {
        "id": shard_id, "model": "tiny", "profile": "p1", "engine": engine,
        "engine_version": "1", "source": source, "sha256": "", "context": 512,
        "parallel": 1, "gpus": 0, "args": [], "key": f"key-for-{shard_id}", **kw,
    }  # fmt: skip


def _is_ours(pid: int, tmp_path: Path) -> bool:
    """A pid read from a message may be reused by now: only touch our own engines."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(tmp_path).encode() in cmdline


class Node:
    """One node's agent config and files; `start()` runs the real llmgw-agentd."""

    def __init__(self, tmp_path: Path, scheduler: FakeScheduler, name: str = NODE):
        self.tmp = tmp_path
        self.name = name
        self.etc = tmp_path / "etc"
        self.state = tmp_path / "state"
        self.curve = self.etc / "pki" / "curve"
        self.public = bus.create_keypair(self.curve, name)
        self.scheduler = scheduler
        self.procs: list[Proc] = []
        self.engine_pids: set[int] = set()
        self.ports = free_range()

    def config(self, engines: dict[str, list[str]] | None = None, **agent) -> Path:
        engines = {"fake": FAKE_ENGINE, **(engines or {})}
        settings = {
            "name": self.name, "schedulers": [f"tcp://127.0.0.1:{self.scheduler.port}"],
            "host": "127.0.0.1", "port_min": self.ports[0], "port_max": self.ports[1],
            "heartbeat_s": 0.3, "metrics_listen": "127.0.0.1:0", "memory_bytes": MEMORY,
            "log_lines": 50, **agent,
        }  # fmt: skip
        lines = [
            "[log]", 'level = "debug"', "[paths]", f'config_dir = "{self.etc}"',
            f'state_dir = "{self.state}"', f'backup_dir = "{self.tmp / "backups"}"', "[agent]",
        ]  # fmt: skip
        lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        for name, command in engines.items():
            lines += ["[[agent.engines]]", f'name = "{name}"', 'version = "1"',
                      f"command = {json.dumps(command)}"]  # fmt: skip
        path = self.tmp / f"{self.name}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, **settings) -> Proc:
        cfg = self.config(**settings)
        n = len(self.procs)
        proc = Proc([sys.executable, "-m", "llmgw_agentd.main", "--config", str(cfg)],
                    self.tmp / f"{self.name}-{n}.log")  # fmt: skip
        self.procs.append(proc)
        return proc

    def remember(self, shard: dict) -> dict:
        if shard.get("pid"):
            self.engine_pids.add(shard["pid"])
        return shard

    def cleanup(self) -> None:
        for proc in self.procs:
            proc.stop(signal.SIGKILL)
        pids = set(self.engine_pids)
        for file in (self.state / "shards").glob("*.json"):
            pids.add(json.loads(file.read_text())["pid"])
        for pid in pids:
            if _is_ours(pid, self.tmp):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def scheduler(tmp_path):
    sched = FakeScheduler(tmp_path / "etc" / "pki" / "curve")
    yield sched
    sched.close()


@pytest.fixture
def node(tmp_path, scheduler):
    n = Node(tmp_path, scheduler)
    scheduler.register(n.name, n.public)
    yield n
    n.cleanup()


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 1020)
    return path
