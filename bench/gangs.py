"""Benchmark gang placement: 100 models that span nodes, over 1,000 nodes, in one pass.

    .venv/bin/python bench/gangs.py        # a few seconds; writes bench/GANGS.md

A pass that places a replica across nodes must not cost much more than one that places
one-node replicas, or a fleet with a few big models would slow every pass. The bar
(issue #15): 100 multi-node models over 1,000 nodes in at most 100 ms. The baseline, in
the same run: `place_many` of the same 100 models as one-node needs over the same nodes
(which finds nowhere for most of them, since they are bigger than a node, and so also
measures how quickly "fits nowhere" is found). Nodes vary in free memory, fabric and
engine state so that placement has to look. Each figure is the median of several runs.
"""

import argparse
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

from llmgw.gangs import AUTO, GangFleet
from llmgw.placement import GiB, Need, NodeView, place_many

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "llama.cpp-0.3.36"
BAR_MS = 100.0


def fleet(n: int, rng: random.Random) -> tuple[list[NodeView], dict[str, tuple[str, str]]]:
    nodes, fabrics = [], {}
    for i in range(n):
        x = rng.random()
        engines = {ENGINE: "installed"} if x < 0.8 else ({} if x < 0.95 else
                                                         {ENGINE: "failed: exit 1"})  # fmt: skip
        nodes.append(NodeView(f"node-{i:04d}", memory_free=rng.randint(8, 64) * GiB,
                              engines=engines, lost=rng.random() < 0.01))  # fmt: skip
        address = f"10.{i // 250}.{i % 250}.1" if rng.random() < 0.97 else ""
        fabrics[f"node-{i:04d}"] = (f"rack-{i % 20}", address)
    return nodes, fabrics


def needs(n: int, rng: random.Random) -> list[tuple[Need, int]]:
    """Models of 70-300 GiB, bigger than any node: half "auto", half a fixed count."""
    out = []
    for i in range(n):
        memory = rng.randint(70, 300) * GiB
        wanted = AUTO if i % 2 else rng.randint(6, 12)
        out.append((Need(f"big-{i}", memory, 0, ENGINE), wanted))
    return out


def time_ms(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench" / "GANGS.md"))
    args = ap.parse_args()
    rng = random.Random(15)
    nodes, fabrics = fleet(args.nodes, rng)
    wanted = needs(args.models, rng)
    placed = 0

    def gangs():
        nonlocal placed
        f = GangFleet(nodes, fabrics)
        placed = 0
        for need, n in wanted:
            g = f.place(need, n)
            if g.placed:
                f.take(need, g)
                placed += 1

    def whole():
        place_many([need for need, _ in wanted], nodes)

    gang_ms = time_ms(gangs, args.runs)
    whole_ms = time_ms(whole, args.runs)
    ratio = gang_ms / whole_ms if whole_ms else float("inf")
    verdict = "holds" if gang_ms <= BAR_MS else "MISSED"
    lines = [
        "# Gang placement",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.python_implementation()} "
        f"{platform.python_version()}, `bench/gangs.py` (median of {args.runs} runs).",
        "",
        "| pass | models | nodes | placed | ms | ratio to baseline |",
        "|---|---|---|---|---|---|",
        f"| gangs (`GangFleet.place` + `take`) | {args.models} | {args.nodes} | {placed} "
        f"| {gang_ms:.1f} | {ratio:.1f}× |",
        f"| baseline: one-node `place_many` | {args.models} | {args.nodes} | - "
        f"| {whole_ms:.1f} | 1.0× |",
        "",
        f"Bar: at most {BAR_MS:.0f} ms for the gang pass: **{verdict}**.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
