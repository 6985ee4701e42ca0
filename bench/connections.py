"""Benchmark: one router holding 10,000 concurrent keep-alive client connections.

    .venv/bin/python bench/connections.py [--connections N]   # ~1 min; bench/CONNECTIONS.md

The router (keys, usage spool, metrics, as `make bench` runs it) runs on CPU 1, the
fake engine and this client on CPU 0. The client opens N connections (in waves, so
the kernel's accept queue is not what is measured), sends one chat completion on each,
all at once, and reads every answer; then, with every connection open and idle, reads
the router's resident memory; then sends a second round on the same connections (so
they were kept alive, not re-opened). Any connection refused or reset, any answer
other than 200, any answer not back within --timeout-s, counts as an error.

Bar (issue #12): no errors at 10,000 connections; resident memory at 10,000 idle
connections at most 250 MB. Reported beside the router's memory before the clients
came, in the same run.
"""

import argparse
import asyncio
import platform
import resource
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import targets
from loadgen import CHAT_PATH, chat_body, raw_request

OUT = Path(__file__).resolve().parent / "CONNECTIONS.md"
RSS_BAR_MB = 250
WAVE = 500  # connections opened at once


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


class Client:
    """One keep-alive connection sending one request at a time."""

    def __init__(self, host: str, port: int, request: bytes):
        self.host, self.port, self.request = host, port, request
        self.reader = self.writer = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def ask(self, timeout_s: float) -> tuple[int, float]:
        t = time.perf_counter()
        self.writer.write(self.request)
        async with asyncio.timeout(timeout_s):
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await self.reader.readexactly(length)
        return status, time.perf_counter() - t

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def round_of(clients: list[Client], timeout_s: float) -> tuple[int, list[float], str]:
    results = await asyncio.gather(*(c.ask(timeout_s) for c in clients), return_exceptions=True)
    errors, latencies, first = 0, [], ""
    for r in results:
        if isinstance(r, BaseException) or r[0] != 200:
            errors += 1
            first = first or (repr(r) if isinstance(r, BaseException) else f"HTTP {r[0]}")
        else:
            latencies.append(r[1])
    return errors, latencies, first


async def hold(port: int, api_key: str, n: int, timeout_s: float, pid: int) -> dict:
    request = raw_request("127.0.0.1", port, CHAT_PATH, chat_body(False), api_key)
    clients = [Client("127.0.0.1", port, request) for _ in range(n)]
    refused = 0
    for i in range(0, n, WAVE):
        opened = await asyncio.gather(*(c.open() for c in clients[i : i + WAVE]),
                                      return_exceptions=True)  # fmt: skip
        refused += sum(isinstance(o, BaseException) for o in opened)
    live = [c for c in clients if c.writer is not None]
    t = time.perf_counter()
    errors1, lat1, first1 = await round_of(live, timeout_s)
    took1 = time.perf_counter() - t
    await asyncio.sleep(2)  # let the usage writer and the allocator settle
    idle_rss = rss_mb(pid)
    errors2, lat2, first2 = await round_of(live, timeout_s)
    for c in clients:
        c.close()
    return {
        "refused": refused, "errors": errors1 + errors2, "first_error": first1 or first2,
        "round_s": took1, "idle_rss": idle_rss,
        "p50_ms": statistics.median(lat1 + lat2) * 1e3 if lat1 + lat2 else 0.0,
        "max_ms": max(lat1 + lat2) * 1e3 if lat1 + lat2 else 0.0,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    args = ap.parse_args()
    # The router holds a socket per client and, at the peak, one per request to the
    # engine; the client and the engine as many each.
    want = args.connections * 3 + 4096
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:  # root may raise the hard limit too (the router's unit says LimitNOFILE=65536)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(want, hard)), hard))
    targets.WORK.mkdir(parents=True, exist_ok=True)
    cpus = targets.os.cpu_count() or 1
    load_cpu, proxy_cpu = (0, 1) if cpus >= 2 else (None, None)
    engine = targets.Engine(load_cpu, 20, 0.0)
    router = targets.Router(engine, proxy_cpu)
    try:
        engine.start()
        router.start()
        if load_cpu is not None:
            targets.os.sched_setaffinity(0, {load_cpu})
        time.sleep(3)  # the key's first load
        base_rss = rss_mb(router.pid)
        got = asyncio.run(hold(router.port, router.api_key, args.connections, args.timeout_s,
                               router.pid))  # fmt: skip
    finally:
        router.stop()
        engine.stop()
    if got["first_error"]:
        print("first error:", got["first_error"], file=sys.stderr)
    ok = got["errors"] == 0 and got["refused"] == 0
    mem_ok = got["idle_rss"] <= RSS_BAR_MB
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# Benchmark: 10,000 client connections on one router

Generated by `bench/connections.py` on {when}; {cpus} CPUs, Python {platform.python_version()}.
The router (`router.transport = "http1"`, keys, usage spool, metrics) on CPU 1; the fake
engine and the client on CPU 0.

| connections | refused | errors (any non-200, reset, or over {args.timeout_s:g} s) | first round | latency p50 / max | router RSS before | RSS at {args.connections:,} idle |
|--:|--:|--:|--:|--:|--:|--:|
| {args.connections:,} | {got["refused"]} | {got["errors"]} | {got["round_s"]:.2f} s | {got["p50_ms"]:.0f} / {got["max_ms"]:.0f} ms | {base_rss:.0f} MB | {got["idle_rss"]:.0f} MB |

Against the bar (issue #12):

- {args.connections:,} concurrent keep-alive connections, no errors: {"meets" if ok else "MISSES"}{"" if ok else f" (first: {got['first_error']})"}
- resident memory at {args.connections:,} idle connections ≤ {RSS_BAR_MB} MB: {got["idle_rss"]:.0f} MB, {"meets" if mem_ok else "MISSES"}

Every connection sent one chat completion, all at once, then (after the RSS reading,
all of them open and idle) a second one on the same connection.
"""  # noqa: E501
    OUT.write_text(text)
    print(text)
    return 0 if ok and mem_ok else 1


if __name__ == "__main__":
    sys.exit(main())
