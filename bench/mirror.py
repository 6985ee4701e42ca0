"""Fetching weights from the control plane's mirror: the agent's fetch against curl.

    .venv/bin/python bench/mirror.py [--mib 512] [--runs 3]

Runs the real scheduler on loopback (the tests' Cluster helper) with one model whose
weights are a file of random bytes, pulls it into the mirror with `llmgw weights pull`,
registers a node, then downloads the blob from the scheduler's admin API in turn with
`curl -o FILE` (the baseline: no hashing, no resume bookkeeping) and with the agent's
own code (`llmgw_agentd.weights.Weights`, which also hashes every byte and writes
through a partial file), each to a fresh file on the same disk. Reports the best of
`--runs` for each and the ratio agent/curl throughput (the issue's bar: >= 0.8).
Writes bench/MIRROR.md.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmgw import mirror  # noqa: E402
from llmgw.store import ClusterSecret, open_store  # noqa: E402
from llmgw_agentd.weights import Weights  # noqa: E402
from tests.system.conftest import Cluster, GiB  # noqa: E402

MiB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as d:
        tmp = Path(d)
        os.environ["LLMGW_STORE"] = f"sqlite://{tmp}/llmgw.db"
        source = tmp / "big.gguf"  # the Cluster writes its own weights.gguf
        with open(source, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        cluster = Cluster(tmp)
        cluster.add_model("m", memory=GiB, source=str(source), min_=0)
        try:
            cluster.start_scheduler()
            pulled = cluster.ctl("weights", "pull", "m")
            assert pulled.returncode == 0, pulled.stderr
            assert cluster.ctl("nodes", "add", "bench").returncode == 0
            open_store(os.environ["LLMGW_STORE"])
            secret = ClusterSecret.get(ClusterSecret.name == "engine_keys").value
            (row,) = cluster.admin("/v1/weights")
            manifest = {
                "url": f"http://127.0.0.1:{cluster.admin_port}", "node": "bench",
                "token": mirror.node_token(secret, "bench"), "sha256": row["sha256"],
                "files": row["files"],
            }  # fmt: skip
            url = f"{manifest['url']}/v1/mirror/blobs/{row['sha256']}"
            curl, agent = [], []

            def with_curl(i: int) -> None:
                out = tmp / f"curl-{i}"
                t0 = time.perf_counter()
                subprocess.run(
                    ["curl", "-sSf", "-o", str(out), "-H", "X-Llmgw-Node: bench",
                     "-H", f"Authorization: Bearer {manifest['token']}", url], check=True,
                )  # fmt: skip
                curl.append(time.perf_counter() - t0)
                assert out.stat().st_size == row["size"] == args.mib * MiB
                out.unlink()

            def with_agent(i: int) -> None:
                t0 = time.perf_counter()
                path = Weights(tmp / f"agent-{i}").fetch(str(source), "", manifest)
                agent.append(time.perf_counter() - t0)
                assert path.stat().st_size == row["size"]
                path.unlink()

            for i in range(args.runs):
                # Each goes first in turn, and the disk's writeback settles between them
                # (`sync`): the one after a 512 MiB write otherwise pays for it.
                for run in (with_curl, with_agent) if i % 2 == 0 else (with_agent, with_curl):
                    os.sync()
                    run(i)
        finally:
            cluster.stop()
    size = args.mib * MiB
    best_curl, best_agent = min(curl), min(agent)
    ratio = best_curl / best_agent
    median = statistics.median(curl) / statistics.median(agent)
    lines = [
        "# Mirror fetch: the agent against curl",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M}Z, {args.mib} MiB of random bytes, best of"
        f" {args.runs}, loopback, the real scheduler's admin API serving the blob"
        f" ({os.cpu_count()} CPUs).",
        "",
        "| client | best s | MiB/s | vs curl |",
        "|---|---|---|---|",
        f"| curl -o FILE (baseline) | {best_curl:.2f} | {size / MiB / best_curl:.0f} | 1.00 |",
        f"| agent (Weights: hash + write + verify) | {best_agent:.2f} |"
        f" {size / MiB / best_agent:.0f} | {ratio:.2f} |",
        "",
        f"Every run: curl {', '.join(f'{t:.2f}' for t in curl)} s;"
        f" agent {', '.join(f'{t:.2f}' for t in agent)} s. Median against median:"
        f" {median:.2f}x. Bar: agent >= 0.8x curl.",
    ]
    text = "\n".join(lines) + "\n"
    (ROOT / "bench" / "MIRROR.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
