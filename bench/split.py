"""Benchmark a replica across nodes against the same model whole, in one run.

    .venv/bin/python bench/split.py        # ~1-2 min; writes bench/SPLIT.md

Two llama.cpp `rpc-server`s on loopback hold the demo model's layers half each, and a
leader `llama-server --rpc … --tensor-split 0.5,0.5 -ngl 99` serves it, as an llmgw gang
of two runs it (tools/agentd/workers.py); beside it, in the same run, one `llama-server`
holds the whole model. Each answers the same streamed completions one after another:
time to first token (the first streamed chunk with text) and tokens per second (from
llama-server's own `timings.predicted_per_second` on the last chunk). Loopback is no
fabric: this measures what splitting costs in compute and copies, not a network.
Each server gets the same threads; the figures are medians, reported as split / whole.
"""

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.e2e.test_llama_server import engine_binary, model_file  # noqa: E402

PROMPT = "The history of the city of Paris begins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not listen within {timeout:.0f} s")


def wait_healthy(url: str, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} was not healthy within {timeout:.0f} s")


def measure(url: str, key: str, n: int, max_tokens: int) -> tuple[list[float], list[float]]:
    """(TTFT seconds, tokens/s) of `n` streamed completions, one after another."""
    ttft, tps = [], []
    for i in range(n):
        body = {"prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}  # fmt: skip
        start = time.perf_counter()
        first = None
        last = {}
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120,
                           headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - start
                last = chunk
        ttft.append(first if first is not None else time.perf_counter() - start)
        timings = last.get("timings") or {}
        if timings.get("predicted_per_second"):
            tps.append(float(timings["predicted_per_second"]))
    return ttft, tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--out", default=str(ROOT / "bench" / "SPLIT.md"))
    args = ap.parse_args()
    server = Path(engine_binary())
    rpc = server.with_name("rpc-server")
    if not rpc.exists():
        raise SystemExit(f"no rpc-server beside {server}: run scripts/build-llama-server")
    model = model_file()
    key = secrets.token_urlsafe(16)
    work = Path(tempfile.mkdtemp(prefix="llmgw-split-"))
    (work / "key").write_text(key + "\n")
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], name: str) -> subprocess.Popen:
        log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the process
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        procs.append(p)
        return p

    common = ["-m", str(model), "--api-key-file", str(work / "key"), "-c", "2048", "-np", "1",
              "--host", "127.0.0.1", "-t", str(args.threads), "--no-jinja",
              "--chat-template", "gemma"]  # fmt: skip
    results = {}
    try:
        workers = []
        for i in range(2):
            port = free_port()
            p = start([str(rpc), "-H", "127.0.0.1", "-p", str(port), "-t", str(args.threads)],
                      f"rpc-{i}")  # fmt: skip
            wait_listening(port, p, f"rpc-server {i}")
            workers.append(f"127.0.0.1:{port}")
        split_port, whole_port = free_port(), free_port()
        split = start([str(server), *common, "--port", str(split_port), "--rpc",
                       ",".join(workers), "--tensor-split", "0.5,0.5", "-ngl", "99"],
                      "leader")  # fmt: skip
        whole = start([str(server), *common, "--port", str(whole_port)], "whole")
        wait_healthy(f"http://127.0.0.1:{split_port}", split, "the split leader")
        wait_healthy(f"http://127.0.0.1:{whole_port}", whole, "the whole server")
        for name, port in (("split", split_port), ("whole", whole_port)):
            url = f"http://127.0.0.1:{port}"
            measure(url, key, 1, 8)  # warm up
            results[name] = measure(url, key, args.requests, args.max_tokens)
    finally:
        for p in procs:
            p.kill()
            p.wait()

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    s_ttft, w_ttft = med(results["split"][0]) * 1000, med(results["whole"][0]) * 1000
    s_tps, w_tps = med(results["split"][1]), med(results["whole"][1])
    lines = [
        "# A replica across nodes against the same model whole",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, `bench/split.py`: Gemma 3 270M"
        f" Q4_K_M, {args.requests} streamed completions of {args.max_tokens} tokens each,"
        f" {args.threads} thread(s) per process, loopback.",
        "",
        "| | TTFT p50 (ms) | tokens/s p50 |",
        "|---|---|---|",
        f"| split over two rpc-servers | {s_ttft:.1f} | {s_tps:.1f} |",
        f"| whole, one llama-server | {w_ttft:.1f} | {w_tps:.1f} |",
        f"| **split / whole** | **{s_ttft / w_ttft:.2f}×** | **{s_tps / w_tps:.2f}×** |",
        "",
        "Both ran in the same run, one after the other, on the same machine. Loopback is",
        "no network: on a real fabric each token also pays a round trip per worker.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
