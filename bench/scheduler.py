"""Benchmark the scheduler's pure parts and the router's routing-table update, by size.

    .venv/bin/python bench/scheduler.py            # ~30-60 s; writes bench/SCHEDULER.md
    .venv/bin/python bench/scheduler.py --baseline dc446ba   # and place_many beside REV's
    .venv/bin/python bench/scheduler.py --routes-baseline 5a9a1d5  # and a router's apply

For N = 100, 1,000 and 10,000 (models = nodes = N): one `place_many` of N needs over N
nodes, and one full `reconcile` pass with some replicas running. Then the real
`Scheduler` in process (SQLite, a fixed clock) with N models over N nodes and one or two
ready replicas of each: `publish`, the routing table it builds and encodes on every
change (under its lock), and `pass`, one whole `tick` (node views, reconcile, drains,
eviction). For 500, 5,000 and
50,000 replicas: what a router's feed does with one whole `routes` table, from the
bytes, into a table that holds the same one (at join, or after a missed diff), and
with one `routes_diff` that replaces 1% of the replicas (at every change, for a router
in step). With --routes-baseline, the whole table also as REV's router applied it.
Each figure is the median of a few runs; the growth column is the ratio to the size
before, so 10 means linear and 100 quadratic. Nodes vary in free memory and engine
state so that placement has to look.
"""

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from llmgw import bus, catalog, config
from llmgw.placement import GiB, Need, NodeView, gpus_of, place_many
from llmgw.reconciler import Backoff, Desired, ReplicaView, reconcile
from llmgw_router.feed import Feed
from llmgw_router.routing import RoutingTable
from llmgw_scheduler.needs import Needs
from llmgw_scheduler.service import Scheduler

ROOT = Path(__file__).resolve().parent.parent

ENGINES = ["llama.cpp-0.3.36", "llama.cpp-0.3.35", "vllm-0.6.3", "llama.cpp-0.4.0"]
TARGETS = {("place_many", 1000): 100.0, ("place_many", 10_000): 200.0, ("routes", 5000): 50.0,
           ("routes", 50_000): 100.0, ("routes_diff", 50_000): 100.0}  # fmt: skip


def fleet(n: int, rng: random.Random) -> list[NodeView]:
    nodes = []
    for i in range(n):
        engines = {}
        for e in ENGINES:
            x = rng.random()
            if x < 0.55:
                engines[e] = "installed"
            elif x < 0.65:
                engines[e] = "installing"
            elif x < 0.70:
                engines[e] = "failed: exit status 1"
        gpu = i % 10 == 0
        nodes.append(NodeView(
            id=f"node-{i:05}", lost=rng.random() < 0.02, draining=rng.random() < 0.03,
            memory_free=rng.randrange(0, 96) * GiB // 2,
            gpus=gpus_of(*(rng.choice([24, 40, 80]) * GiB for _ in range(8))) if gpu else (),
            engines=engines,
        ))  # fmt: skip
    return nodes


def needs(n: int, rng: random.Random) -> list[Need]:
    out = []
    for i in range(n):
        engine = rng.choice(ENGINES)
        gpus = rng.choice([1, 2, 4]) if engine.startswith("vllm") else 0
        memory = rng.choice([20, 30, 60]) * GiB if gpus else rng.randrange(1, 33) * GiB // 2
        # Half the models appear twice, so spread has nodes to skip.
        out.append(Need(f"model-{i // 2 if i % 4 == 0 else i:05}", memory, gpus, engine))
    return out


def world(n: int, rng: random.Random):
    nodes = fleet(n, rng)
    desired, replicas, backoff = [], [], {}
    for i, need in enumerate(needs(n, rng)):
        model = f"model-{i:05}"
        need = Need(model, need.memory, need.gpus, need.engine)
        lo = rng.choice([0, 1, 1, 2, 3])
        desired.append(Desired(model, lo, lo + rng.choice([0, 1, 2]), need))
        for j in range(rng.choice([0, 0, 1, 2, 3, 4])):
            node = nodes[rng.randrange(n)].id
            state = rng.choice(["ready", "ready", "ready", "starting", "pending", "failed"])
            replicas.append(ReplicaView(f"r-{i}-{j}", model, node, state, rng.uniform(0, 1e4)))
        if rng.random() < 0.1:
            backoff[model] = Backoff(2, 2e4 if rng.random() < 0.5 else 0.0)
    replicas += [ReplicaView(f"old-{i}", "retired", nodes[i].id, "ready", 0.0)
                 for i in range(0, n, 50)]  # fmt: skip
    return nodes, desired, replicas, backoff


def replica(i: int, n: int, port: int = 8100) -> dict:
    return {"id": f"r-{i:06x}", "model": f"model-{i % max(1, n // 4)}", "aliases": [],
            "endpoint": f"http://10.0.{i // 250 % 256}.{i % 250 + 1}:{port}",
            "key": f"{i:064x}", "state": "ready", "engine": "llama.cpp-0.3.36"}  # fmt: skip


def routes_message(n: int, version: int = 1) -> bytes:
    """A whole table of N ready replicas, as the scheduler publishes it."""
    body = {"seq": version, "table": "bench", "version": version,
            "replicas": [replica(i, n) for i in range(n)], "models": []}  # fmt: skip
    return bus.encode("routes", "scheduler", body)


def diff_message(n: int, version: int) -> bytes:
    """A change to that table: 1% of its replicas replaced by new ones."""
    k = max(1, n // 100)
    first = (version * k) % n
    gone = [replica((first + j) % n, n)["id"] for j in range(k)]
    new = [{**replica((first + j) % n, n, 9000 + version), "id": f"r-{version}-{j}"}
           for j in range(k)]  # fmt: skip
    body = {"seq": version, "table": "bench", "version": version, "base": version - 1,
            "replicas": new, "removed": gone}  # fmt: skip
    return bus.encode("routes_diff", "scheduler", body)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def bench_place(n: int) -> float:
    rng = random.Random(n)
    nodes, todo = fleet(n, rng), needs(n, rng)
    return median_ms(lambda: place_many(todo, nodes), 5 if n < 10_000 else 3)


def load_placement(rev: str):
    """lib/llmgw/placement.py as it was at git revision `rev`, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:lib/llmgw/placement.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout  # fmt: skip
    spec = importlib.util.spec_from_loader(f"placement_{rev}", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:lib/llmgw/placement.py", "exec"), module.__dict__)
    return module


def bench_place_beside(n: int, old) -> tuple[float, float]:
    """(baseline, now) ms for place_many at N, run in turns in this process on the same
    views, after checking both place every need alike."""
    rng = random.Random(n)
    nodes, todo = fleet(n, rng), needs(n, rng)
    old_nodes = [old.NodeView(v.id, v.lost, v.draining, v.memory_free,
                              tuple(g.free for g in v.gpus), v.engines,
                              v.replicas) for v in nodes]  # fmt: skip
    old_todo = [old.Need(d.model, d.memory, d.gpus, d.engine) for d in todo]
    got = [p.node for p in place_many(todo, nodes)]
    if got != [p.node for p in old.place_many(old_todo, old_nodes)]:
        raise SystemExit("place_many: the baseline placed some need elsewhere")
    base, now = [], []
    for _ in range(7):
        base.append(median_ms(lambda: old.place_many(old_todo, old_nodes), 1))
        now.append(median_ms(lambda: place_many(todo, nodes), 1))
    return statistics.median(base), statistics.median(now)


def bench_reconcile(n: int) -> float:
    nodes, desired, replicas, backoff = world(n, random.Random(n))
    reps = 5 if n < 10_000 else 3
    return median_ms(lambda: reconcile(desired, replicas, nodes, backoff, 1e4), reps)


def bench_routes(n: int) -> float:
    """A whole table applied by the feed, from the bytes, onto the same table held."""
    data = routes_message(n)
    table = RoutingTable()
    feed = Feed(table, [], keys=None, server_public="")
    feed.handle(data)  # the table holds the previous snapshot, as in steady state
    ms = median_ms(lambda: feed.handle(data), 7 if n < 50_000 else 5)
    feed.stop()
    return ms


def bench_diff(n: int) -> float:
    """A change (1% of replicas replaced) applied by the feed, from the bytes, onto a
    table of N: what a router in step does at each change."""
    table = RoutingTable()
    feed = Feed(table, [], keys=None, server_public="")
    feed.handle(routes_message(n))
    reps = 7 if n < 50_000 else 5
    diffs = iter([diff_message(n, v) for v in range(2, reps + 2)])
    ms = median_ms(lambda: feed.handle(next(diffs)), reps)
    if feed.version != reps + 1 or len(table.endpoints()) != n:
        raise SystemExit("routes_diff: a diff was not applied")
    feed.stop()
    return ms


# A router's apply as it was at a git revision (decode, endpoints_from, replace), timed
# in a process of its own that imports that revision's lib/llmgw and tools/router.
_OLD_ROUTES = """
import statistics, sys, time
sys.path[:0] = [sys.argv[1]]
from llmgw import bus
from llmgw_router.feed import endpoints_from
from llmgw_router.routing import RoutingTable
if not sys.modules[RoutingTable.__module__].__file__.startswith(sys.argv[1]):
    raise SystemExit("imported the working tree, not the revision")
data = open(sys.argv[2], "rb").read()
table = RoutingTable()
def apply():
    table.replace(endpoints_from(bus.decode(data)["body"]))
apply()
times = []
for _ in range(int(sys.argv[3])):
    start = time.perf_counter()
    apply()
    times.append((time.perf_counter() - start) * 1000)
print(statistics.median(times))
"""


def bench_routes_beside(n: int, rev: str) -> tuple[float, float, float]:
    """(REV's apply of a whole table, now's, now's apply of a diff) in ms at N, in turns."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "lib/llmgw", "tools/router"],
                                 cwd=ROOT, check=True, capture_output=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        pkgs = Path(tmp) / "pkgs"
        pkgs.mkdir()
        (pkgs / "llmgw").symlink_to(Path(tmp) / "lib" / "llmgw")
        (pkgs / "llmgw_router").symlink_to(Path(tmp) / "tools" / "router")
        msg = Path(tmp) / "routes.json"
        msg.write_bytes(routes_message(n))
        old, whole, diff = [], [], []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", _OLD_ROUTES, str(pkgs), str(msg), "3"],
                                 check=True, capture_output=True, text=True).stdout  # fmt: skip
            old.append(float(out))
            whole.append(bench_routes(n))
            diff.append(bench_diff(n))
        return statistics.median(old), statistics.median(whole), statistics.median(diff)


def scheduler_world(n: int, tmp: str) -> Scheduler:
    """A scheduler that has heard every node's hello: N models, each with min 1, max 2
    and one or two ready replicas, so a pass has nothing to start."""
    from llmgw.store import migrate, open_store

    rng = random.Random(n)
    migrate(open_store(f"sqlite://{tmp}/bench.db"))
    cfg = config.Config()
    cfg.scheduler.settle_s = 0.0
    configs = [
        config.model_from({"name": f"model-{i:05}", "source": f"/m/{i}.gguf",
                           "profile": {"memory_bytes": GiB}, "scaling": {"min": 1, "max": 2}})
        for i in range(n)
    ]  # fmt: skip
    sched = Scheduler(cfg, catalog.load(configs), "secret", Needs(Path(tmp) / "weights"),
                      clock=lambda: 1e4, rng=random.Random(1))  # fmt: skip
    sched.install_catalog(configs)
    shards: dict[str, list] = {f"node-{i:05}": [] for i in range(n)}
    for i in range(n):
        for j in range(rng.choice([1, 1, 2])):
            node = f"node-{rng.randrange(n):05}"
            shards[node].append({"id": f"r-{i}-{j}", "model": f"model-{i:05}", "state": "ready",
                                 "endpoint": f"http://{node}:8100", "rss": GiB})  # fmt: skip
    for node, mine in shards.items():
        body = {"resources": {"cpus": 8, "memory_total": 64 * GiB,
                              "memory_available": 32 * GiB, "gpus": []},
                "engines": {"llama.cpp-0.3.36": {"state": "installed", "reason": ""}},
                "shards": mine}  # fmt: skip
        sched.handle(node, json.loads(bus.encode("hello", node, body, 0)))
    sched.tick()
    sched.outbox.clear()
    return sched


def bench_scheduler(n: int) -> tuple[float, float]:
    """(publish, pass) in ms for the real scheduler at N models over N nodes."""
    with tempfile.TemporaryDirectory() as tmp:
        sched = scheduler_world(n, tmp)
        reps = 5 if n < 10_000 else 3
        publish = median_ms(lambda: bus.encode("routes", "scheduler", sched.routes(), 1), reps)
        return publish, median_ms(sched.tick, reps)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs, {cpu}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also time place_many as it was at this git revision, in turns",
    )
    parser.add_argument(
        "--routes-baseline",
        metavar="REV",
        help="also time a router's apply of 50,000 replicas as it was at this revision",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    measured = {n: bench_scheduler(n) for n in (100, 1_000, 10_000)}
    for label, sizes, fn in [
        ("place_many", [100, 1_000, 10_000], bench_place),
        ("reconcile", [100, 1_000, 10_000], bench_reconcile),
        ("publish", [100, 1_000, 10_000], lambda n: measured[n][0]),
        ("pass", [100, 1_000, 10_000], lambda n: measured[n][1]),
        ("routes", [500, 5_000, 50_000], bench_routes),
        ("routes_diff", [500, 5_000, 50_000], bench_diff),
    ]:
        prev = None
        for n in sizes:
            ms = fn(n)
            growth = f"{ms / prev:.1f}×" if prev else ""
            target = TARGETS.get((label, n))
            verdict = ""
            if target is not None:
                verdict = f"≤ {target:g} ms: " + ("met" if ms <= target else "MISSED")
            rows.append((label, f"{n:,}", f"{ms:.2f}", growth, verdict))
            print(f"{label:<11} {n:>7,} {ms:9.2f} ms {growth:>7} {verdict}", flush=True)
            prev = ms
    head = ["what", "N", "median ms", "growth", "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = (
        "# Scheduler and routing-table benchmark\n\n"
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {machine()}, load average "
        f"{load_before:.2f} at the start and {{load_after}} at the end (a shared machine: "
        "figures under load run long). Made by `.venv/bin/python bench/scheduler.py`.\n\n"
        "place_many: N needs over N nodes. reconcile: one pass, N models over N nodes, "
        "some replicas running. publish and pass: the real scheduler in process, N models "
        "over N nodes, building and encoding its routing table, and one whole pass. "
        "routes: one whole `routes` table of N replicas applied by a router's feed "
        "(JSON decode, endpoints, table replace) onto the same table held: what a router "
        "does when it joins, misses a diff, or follows a scheduler that sends no diffs. "
        "routes_diff: one change (1% of the N replicas replaced) applied by a router that "
        "holds the table: what a router in step does at every change (it is not sent the "
        "whole table). Growth: ratio to the size before "
        "(the sizes grow 10×, so 10× is linear).\n\n" + "\n".join(lines) + "\n"
    )
    if args.baseline:
        old = load_placement(args.baseline)
        side = [
            "",
            f"place_many beside `{args.baseline}`, in turns in one process on the "
            "same views (both placed every need alike):",
            "",
            f"| N | {args.baseline} ms | now ms | ratio |",
            "|---|---|---|---|",
        ]
        for n in (1_000, 10_000):
            base, now = bench_place_beside(n, old)
            side.append(f"| {n:,} | {base:.2f} | {now:.2f} | {now / base:.2f}× |")
            print(side[-1], flush=True)
        text += "\n".join(side) + "\n"
    if args.routes_baseline:
        rev = args.routes_baseline
        old, whole, diff = bench_routes_beside(50_000, rev)
        side = [
            "",
            f"A router applying 50,000 replicas beside `{rev}` (its decode, endpoints_from "
            "and replace, in a process of its own), in turns, medians of three turns:",
            "",
            f"| {rev} whole table ms | now whole table ms | now change ms |",
            "|---|---|---|",
            f"| {old:.2f} | {whole:.2f} ({whole / old:.2f}×) | {diff:.2f} ({diff / old:.2f}×) |",
        ]
        print(side[-1], flush=True)
        text += "\n".join(side) + "\n"
    text = text.replace("{load_after}", f"{os.getloadavg()[0]:.2f}", 1)
    (ROOT / "bench" / "SCHEDULER.md").write_text(text)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
