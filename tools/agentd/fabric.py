"""`llmgw fabric test`, the agent's half: a TCP echo/sink on the fabric address, opened
only while a test runs, and the client that measures latency and bandwidth to another
node's.

Why TCP between agents rather than NCCL: it needs nothing but the agents, so it runs on
CPU nodes and in CI, and it measures the path NCCL's socket transport uses when
there is no InfiniBand. (NCCL all-reduce over GPUs is the next step on GPU nodes.)

The endpoint is opened on demand (`fabric_listen` from the scheduler, over the CURVE
bus), bound to `agent.fabric_address` only — never a wildcard address — and admits only
a client that first sends the one-time token that came with that command. It closes
after one test, or when its time is up, whichever comes first.

Protocol, after `TOKEN\\n`: `E` then echo every byte back until EOF (latency), or `S`
then read until EOF and answer with the count as `N\\n` (bandwidth).
"""

import hmac
import socket
import statistics
import threading
import time
from collections.abc import Callable

from llmgw import log
from llmgw.config import AgentConfig

_log = log.get("llmgw.agentd.fabric")

READY, RESULT = "fabric_ready", "fabric_result"
LISTEN_S = 30.0  # an endpoint nobody used closes after this long
PING_BYTES = 32
CHUNK = 1 << 20
IO_TIMEOUT_S = 20.0
WILDCARDS = ("", "0.0.0.0", "::", "[::]")

Post = Callable[[str, dict], None]


def _bind(address: str, lo: int, hi: int) -> socket.socket:
    """A listening socket on `address`, on a port in lo..hi (0 and 0: any)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    ports = range(lo, hi + 1) if lo and hi else [0]
    last: OSError | None = None
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
            sock.listen(2)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise OSError(f"no free port in {lo}-{hi} on {address}: {last}")


def _recv_line(conn: socket.socket, limit: int = 256) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        b = conn.recv(1)
        if not b or len(data) > limit:
            break
        data += b
    return data.rstrip(b"\n")


def _serve_one(conn: socket.socket, token: str) -> str:
    """One client: "echo", "sink", or "" for one that did not know the token."""
    conn.settimeout(IO_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if not hmac.compare_digest(_recv_line(conn), token.encode()):
        return ""
    mode = conn.recv(1)
    if mode == b"E":
        while data := conn.recv(4096):
            conn.sendall(data)
        return "echo"
    if mode == b"S":
        n = 0
        while data := conn.recv(CHUNK):
            n += len(data)
        conn.sendall(b"%d\n" % n)
        return "sink"
    return ""


def serve(sock: socket.socket, token: str, deadline: float) -> None:
    """Answer clients on `sock` until one has run a sink (the end of a test) or the
    deadline; then close it."""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            sock.settimeout(left)
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                return
            with conn:
                try:
                    if _serve_one(conn, token) == "sink":
                        return
                except OSError:
                    continue
    finally:
        sock.close()


def _connect(address: str, port: int, token: str, mode: bytes) -> socket.socket:
    conn = socket.create_connection((address, port), timeout=IO_TIMEOUT_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(token.encode() + b"\n" + mode)
    return conn


def measure(address: str, port: int, token: str, pings: int = 50,
            size: int = 64 * CHUNK) -> dict:  # fmt: skip
    """Round trips of a small message (latency) and a one-way stream of `size` bytes
    (bandwidth) to an endpoint. Raises OSError when the endpoint cannot be reached."""
    rtts = []
    payload = b"x" * PING_BYTES
    refused = "the endpoint closed the connection (wrong token?)"
    with _connect(address, port, token, b"E") as conn:
        for _ in range(pings):
            t0 = time.perf_counter()
            try:
                conn.sendall(payload)
                got = 0
                while got < len(payload):
                    data = conn.recv(len(payload) - got)
                    if not data:
                        raise OSError(refused)
                    got += len(data)
            except (ConnectionResetError, BrokenPipeError):
                raise OSError(refused) from None
            rtts.append(time.perf_counter() - t0)
    block = b"\0" * CHUNK
    with _connect(address, port, token, b"S") as conn:
        t0 = time.perf_counter()
        sent = 0
        while sent < size:
            n = min(CHUNK, size - sent)
            conn.sendall(block[:n])
            sent += n
        conn.shutdown(socket.SHUT_WR)
        answer = _recv_line(conn)
        seconds = time.perf_counter() - t0
    if not answer.isdigit() or int(answer) != size:
        raise OSError(f"the endpoint counted {answer.decode(errors='replace')!r} of {size} bytes")
    return {
        "latency_ms": round(statistics.median(rtts) * 1000, 3),
        "latency_min_ms": round(min(rtts) * 1000, 3),
        "pings": pings,
        "bytes": size,
        "seconds": round(seconds, 4),
        "bits_per_second": round(size * 8 / seconds) if seconds > 0 else None,
    }


class Tester:
    """The agent's fabric test: open an endpoint, or measure to another node's. Both run
    in threads; `post(kind, body)` sends the answer to the schedulers."""

    def __init__(self, cfg: AgentConfig, node: str, post: Post):
        self.cfg = cfg
        self.node = node
        self.post = post

    def handle(self, kind: str, body: dict) -> None:
        target = self._listen if kind == "fabric_listen" else self._test
        threading.Thread(target=target, args=(body,), name=kind, daemon=True).start()

    def _listen(self, body: dict) -> None:
        reply = {"request": body.get("request", ""), "node": self.node, "error": ""}
        address = self.cfg.fabric_address
        if address in WILDCARDS:
            reply["error"] = (
                f"agent.fabric_address is {address or 'not set'}: the test endpoint binds"
                " only to this node's fabric address"
            )
            self.post(READY, reply)
            return
        try:
            sock = _bind(address, self.cfg.fabric_test_port_min, self.cfg.fabric_test_port_max)
        except OSError as e:
            reply["error"] = f"cannot listen on {address}: {e}"
            self.post(READY, reply)
            return
        port = sock.getsockname()[1]
        seconds = min(float(body.get("seconds") or LISTEN_S), 300.0)
        _log.info("fabric_endpoint_open", address=address, port=port, seconds=seconds)
        self.post(READY, {**reply, "address": address, "port": port})
        serve(sock, str(body.get("token", "")), time.monotonic() + seconds)
        _log.info("fabric_endpoint_closed", address=address, port=port)

    def _test(self, body: dict) -> None:
        reply = {"request": body.get("request", ""), "node": self.node,
                 "target": body.get("target", ""), "error": ""}  # fmt: skip
        try:
            size = max(1, min(int(body.get("bytes") or 64 * CHUNK), 16 << 30))
            pings = max(1, min(int(body.get("pings") or 50), 10_000))
            reply.update(measure(str(body["address"]), int(body["port"]),
                                 str(body.get("token", "")), pings, size))  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            reply["error"] = f"bad fabric_test command: {e}"
        except OSError as e:
            reply["error"] = f"{body.get('address')}:{body.get('port')}: {e}"
        self.post(RESULT, reply)
