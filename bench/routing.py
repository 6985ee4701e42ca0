"""Routing benchmark: round-robin, least-outstanding and prefix-aware routing in front
of two real llama-server replicas of the demo model, beside the two peers a user would
pick for cache-aware routing without Kubernetes (vllm-router and sglang-router, each with
its `cache_aware` policy, in front of the same replicas, in the same run).

    .venv/bin/python bench/routing.py [--turns 4] [--cache-ram MIB]    # or: make bench

Each replica is pinned to one core (taskset, `-t 1`) with `-np 2`, started afresh for
every policy so each starts with a cold cache. The load: 4 groups of 8 conversations,
each group sharing one system prompt of ~1,000-1,500 tokens, each conversation a few
turns with the model's replies appended; closed loop at concurrency 4 (each worker runs
one conversation's turns in order, then takes the next), seeded, `max_tokens` 32,
streamed so time to first token is measured. Reported per policy: prompt tokens the
engines evaluated (Σ `timings.prompt_n`, cross-checked with their
`llamacpp:prompt_tokens_total`), TTFT p50/p95, requests/s, and how many requests a prefix
router held until another finished evaluating their shared prompt. Controls: unique prompts
(nothing to share: prefix must cost nothing), one hot group (every conversation
shares one prompt: the load guard must keep both replicas busy), and two routers behind
a load balancer that alternates between them request by request (each router sees half
of the traffic; under prefix routing they tell each other what they sent where and have
in flight, `router.prefix_peers`, unless --no-share: prefix must still beat
least-outstanding).
Writes bench/ROUTING.md, with the load average before and after (a run on busy cores
says so).
"""

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from targets import VENV_BIN, WORK, clean_env, free_port, spawn, stop, wait_ready

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from llmgw_agentd.engines import Launch, llama_command  # noqa: E402
from llmgw_router.prefix import canonical, text_crc  # noqa: E402
from tests.e2e.test_llama_server import engine_binary, model_file  # noqa: E402

MODEL = "gemma3-270m"
POLICIES = ("round-robin", "least-outstanding", "prefix")
# The peers a user would pick for cache-aware routing without Kubernetes, each with its
# cache_aware policy and its default thresholds, in front of the same two replicas. The
# client sends them the engines' key, which they pass on.
PEERS = {"vllm-router": ("vllm-router", ()), "sglang-router": ("sglang-router", ("launch",))}
# Only with --only: prefix routing whose requests never wait for another's prompt
# evaluation (router.prefix_hold_s = 0), to run beside "prefix".
NO_HOLD = "prefix-without-hold"
GROUPS, PER_GROUP, CONCURRENCY, MAX_TOKENS, SEED = 4, 8, 4, 32, 7
TOPICS = ["tides", "glaciers", "volcanoes", "deserts", "rivers", "forests", "caves"]
WORK_DIR = WORK / "routing"
SHARE = True  # a pair of prefix routers tell each other what they sent where (--no-share)
EXTRA = ""  # --probe-s, --alpha: lines for the routers' [router], or their defaults
ENGINE_ARGS: list[str] = []  # --engine-arg: more llama-server flags for every replica
# Engines start with the agent's own command (tools/agentd/engines.py); --no-swa-full
# takes its --swa-full out, as runs 1-34 in ROUTING-RUNS.md had it.
SWA_FULL = True
LOG_LEVEL = "warning"  # --trace: "debug", each prefix choice and outcome in router.log


def system_prompt(group: int, rng: random.Random, rules: int = 62) -> str:
    """~1,000-1,500 tokens of rules, different for every group from the first words."""
    lines = [f"You are the assistant of team {group}, code name {secrets.token_hex(4)}."]
    for i in range(rules):
        topic = rng.choice(TOPICS)
        lines.append(f"Rule {i} of team {group}: when asked about {topic}, answer with care.")
    return "\n".join(lines)


def conversations(turns: int, groups: int = GROUPS, per_group: int = PER_GROUP,
                  hot: bool = False, unique: bool = False) -> list[dict]:  # fmt: skip
    rng = random.Random(SEED)
    systems = [system_prompt(g, rng) for g in range(groups)]
    out = []
    for g in range(groups):
        for c in range(per_group):
            if unique:
                system = system_prompt(100 + g * per_group + c, rng, rules=30)
            else:
                system = systems[0 if hot else g]
            questions = [
                f"Conversation {g}.{c}, question {t}: tell me one fact about {rng.choice(TOPICS)}."
                for t in range(turns)
            ]
            out.append({"system": system, "questions": questions})
    rng.shuffle(out)
    return out


class Replica:
    def __init__(self, n: int, cpu: int, key_file: Path, cache_ram: int | None):
        self.n, self.cpu, self.key_file, self.cache_ram = n, cpu, key_file, cache_ram
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = WORK_DIR / f"llama-{n}.log"
        self.proc = None

    def start(self) -> None:
        args = ["-t", "1", "-tb", "1", "--no-jinja", "--chat-template", "gemma"]
        if self.cache_ram is not None:
            args += ["--cache-ram", str(self.cache_ram)]
        launch = Launch(model_path=str(model_file()), host="127.0.0.1", port=self.port,
                        key_file=str(self.key_file), context=4096, parallel=2,
                        args=(*args, *ENGINE_ARGS), served_name=MODEL)  # fmt: skip
        cmd = llama_command(Path(engine_binary()), launch)
        if not SWA_FULL:
            cmd.remove("--swa-full")
        self.proc = spawn(cmd, self.log, self.cpu, env=clean_env())
        wait_ready(self.url + "/health", self.proc, self.log, 120, f"llama-server {self.n}")

    def prompt_tokens_total(self, key: str) -> int:
        import urllib.request

        req = urllib.request.Request(self.url + "/metrics",
                                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        m = re.search(r"^llamacpp:prompt_tokens_total\s+(\S+)$", text, re.M)
        return int(float(m.group(1))) if m else -1

    def stop(self) -> None:
        stop(self.proc)


def start_router(policy: str, replicas: list[Replica], key_file: Path, n: int = 0,
                 shares: list[str] = ()):  # fmt: skip
    """Router `n` for `policy`: its own directory (spool, log), the first one's store
    (so one API key serves both of a pair). With `shares` (no --no-share), router n publishes
    on shares[n] as router-n and subscribes to the others."""
    work = WORK_DIR / f"router-{policy}-{n}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store = WORK_DIR / f"router-{policy}-0" / "bench.db"
    port = free_port()
    eps = "".join(
        f'[[router.endpoints]]\nid = "r{r.n}"\nurl = "{r.url}"\nmodels = ["{MODEL}"]\n'
        f'key = "@{key_file}"\n'
        for r in replicas
    )
    share = paths = ""
    if shares:  # keypairs in one directory, both routers registered in the one store
        peers = ", ".join(f'"router-{i}@{s}"' for i, s in enumerate(shares) if i != n)
        share = (f'bus_name = "router-{n}"\nprefix_share = "{shares[n]}"\n'
                 f"prefix_peers = [{peers}]\n")  # fmt: skip
        paths = f'config_dir = "{WORK_DIR / "conf"}"\n'
    config = work / "llmgw.toml"
    routing, hold = (policy, "") if policy != NO_HOLD else ("prefix", "prefix_hold_s = 0\n")
    config.write_text(
        f'[log]\nlevel = "{LOG_LEVEL}"\n[paths]\nstate_dir = "."\n{paths}[router]\n'
        f'listen = "127.0.0.1:{port}"\nrouting = "{routing}"\n'
        f"upstream_timeout_s = 300.0\n{EXTRA}{hold}{share}{eps}"
    )
    env = clean_env(LLMGW_CONFIG=str(config), LLMGW_STORE=f"sqlite:///{store}")
    api_key = None
    if n == 0:
        out = subprocess.run(
            [str(VENV_BIN / "llmgw"), "keys", "create", "--name", "bench", "--json", "--store"],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        api_key = json.loads(out.stdout)["secret"]
        for i in range(len(shares)):
            subprocess.run([str(VENV_BIN / "llmgw"), "routers", "add", f"router-{i}", "--store"],
                           capture_output=True, env=env, check=True)  # fmt: skip
    log = work / "router.log"
    proc = spawn([str(VENV_BIN / "llmgw-router"), "--config", str(config)], log, None, env=env)
    wait_ready(f"http://127.0.0.1:{port}/ready", proc, log, 30, "llmgw-router")
    return proc, f"http://127.0.0.1:{port}", api_key


def start_peer(name: str, replicas: list[Replica]):
    """vllm-router or sglang-router, policy cache_aware, bound to loopback."""
    dist, launch = PEERS[name]
    binary = VENV_BIN / dist
    if not binary.exists():
        sys.exit(f"routing: {dist} is not installed (pip install -e '.[bench]')")
    work = WORK_DIR / f"router-{name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port = free_port()
    cmd = [str(binary), *launch, "--worker-urls", *(r.url for r in replicas),
           "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    log = work / "router.log"
    proc = spawn(cmd, log, None, cwd=work)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, log, 60, dist)
    return proc, f"http://127.0.0.1:{port}"


async def one_turn(session, url, key, messages) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "seed": SEED,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, timings, usage, buf = None, [], {}, {}, b""
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:  # fmt: skip
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: {"):
                    continue
                obj = json.loads(event[6:])
                for choice in obj.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
                timings = obj.get("timings") or timings
                usage = obj.get("usage") or usage
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "reply": "".join(text), "timings": timings, "usage": usage}  # fmt: skip


async def drive(urls: list[str], key: str, convs: list[dict]) -> tuple[list[dict], float]:
    """Every conversation's turns in order, CONCURRENCY at once; each request to the next
    of `urls` in turn (a round-robin load balancer, when there are two)."""
    queue = list(convs)
    results: list[dict] = []
    sent = 0

    async def worker(session):
        nonlocal sent
        while queue:
            conv = queue.pop(0)
            messages = [{"role": "system", "content": conv["system"]}]
            for q in conv["questions"]:
                url, sent = urls[sent % len(urls)], sent + 1
                messages = [*messages, {"role": "user", "content": q}]
                t0 = time.perf_counter()
                res = await one_turn(session, url, key, messages)
                crc = text_crc(canonical({"model": MODEL, "messages": messages}))  # the trace's
                res.update(router=urls.index(url), turn=len(messages) // 2, start=t0,
                           conv=id(conv), took=time.perf_counter() - t0, crc=crc)  # fmt: skip
                results.append(res)
                messages = [*messages, {"role": "assistant", "content": res["reply"]}]

    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    return results, time.perf_counter() - t0


def where_turns_went(policy: str, routers: int) -> str:
    """With --trace, after a prefix run: each conversation's consecutive turns, by whether
    one router took both and whether the second went to the replica of the first, and
    what the engine then evaluated (all cached but the new turn; the conversation's own
    tail again, 60-500 tokens; or the shared system prompt too). The router logs name the
    replica of each request: joined on a crc32 of its prompt's canonical text."""
    went = {}
    for n in range(routers):
        for line in (WORK_DIR / f"router-{policy}-{n}" / "router.log").open():
            m = re.search(r"prefix chose replica=(\S+) .*?crc=(\d+)", line)
            if m:
                went[int(m.group(2))] = m.group(1)
    rows: dict[tuple, list[int]] = {}
    by_conv: dict[int, list[dict]] = {}
    for line in (WORK_DIR / f"requests-{policy}-{routers}.jsonl").open():
        x = json.loads(line)
        by_conv.setdefault(x["conv"], []).append(x)
    for turns in by_conv.values():
        turns.sort(key=lambda x: x["turn"])
        for a, b in zip(turns, turns[1:], strict=False):
            ra, rb = went.get(a["crc"]), went.get(b["crc"])
            n = int(b["timings"].get("prompt_n", 0))
            row = rows.setdefault((a["router"] == b["router"], ra == rb), [0, 0, 0])
            row[0 if n <= 60 else 1 if n <= 500 else 2] += 1
    names = {
        (True, True): "same router, same replica",
        (True, False): "same router, moved",
        (False, True): "other router, same replica",
        (False, False): "other router, moved",
    }
    return "\n".join(
        f"- {names[k]}: {sum(v)} ({v[0]} hit, {v[1]} tail evaluated again, {v[2]} cold)"
        for k, v in sorted(rows.items(), reverse=True)
    )


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_policy(policy: str, convs: list[dict], key_file: Path, engine_key: str,
               cache_ram: int | None, routers: int = 1) -> dict:  # fmt: skip
    replicas = [Replica(n, n % (os.cpu_count() or 1), key_file, cache_ram) for n in range(2)]
    procs, urls, api_key = [], [], None
    try:
        for r in replicas:
            r.start()
        shares = []
        if SHARE and routers > 1 and policy == "prefix":  # each tells the others
            shares = [f"tcp://127.0.0.1:{free_port()}" for _ in range(routers)]
        if policy in PEERS:
            proc, url = start_peer(policy, replicas)
            procs, urls, api_key = [proc], [url], engine_key
        for n in range(routers if policy not in PEERS else 0):
            proc, url, key = start_router(policy, replicas, key_file, n, shares)
            procs.append(proc)
            urls.append(url)
            api_key = api_key or key
        time.sleep(2.5 if routers > 1 else 0)  # the others' key cache: refreshed every 2 s
        results, wall = asyncio.run(drive(urls, api_key, convs))
        holds = sum(router_counter(url, "llmgw_router_prefix_holds_total") for url in urls
                    if policy not in PEERS)  # fmt: skip
        scraped = sum(r.prompt_tokens_total(engine_key) for r in replicas)
        per_replica = []
        for r in replicas:
            per_replica.append(r.prompt_tokens_total(engine_key))
    finally:
        for proc in procs:
            stop(proc)
        for r in replicas:
            r.stop()
    dump = WORK_DIR / f"requests-{policy}-{routers}.jsonl"
    with dump.open("w") as f:
        for x in results:
            f.write(json.dumps({k: v for k, v in x.items() if k != "reply"}) + "\n")
    ttfts = [x["ttft"] for x in results]
    prompt_n = sum(int(x["timings"].get("prompt_n", 0)) for x in results)
    prompt = sum(int(x["usage"].get("prompt_tokens", 0)) for x in results)
    return {
        "policy": policy,
        "requests": len(results),
        "prompt_n": prompt_n,
        "scraped": scraped,
        "per_replica": per_replica,
        "prompt_tokens": prompt,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": pct(ttfts, 0.95),
        "rps": len(results) / wall,
        "wall_s": wall,
        "holds": holds,
    }


def peer_versions() -> str:
    import importlib.metadata

    return ", ".join(f"{d} {importlib.metadata.version(d)}" for d, _ in PEERS.values())


def router_counter(url: str, name: str) -> int:
    """A router's counter, summed over its labels (0 when it has none yet)."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return int(sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)))


def interleaved(policies: tuple, repeat: int, run_one) -> dict:
    """`run_one(policy)` for each policy `repeat` times, the order turned round each
    time; per policy, the median of its runs (median_of)."""
    runs: dict[str, list[dict]] = {}
    for i in range(repeat):
        for policy in policies if i % 2 == 0 else policies[::-1]:
            runs.setdefault(policy, []).append(run_one(policy))
    return {policy: median_of(runs[policy]) for policy in policies if policy in runs}


def median_of(runs: list[dict]) -> dict:
    """One policy's runs (--repeat) as one: the median of every figure, the runs kept."""
    if len(runs) == 1:
        return runs[0]
    m = dict(runs[0], runs=runs)
    for k in ("requests", "prompt_n", "scraped", "prompt_tokens", "holds"):
        m[k] = int(statistics.median(r[k] for r in runs))
    for k in ("ttft_p50", "ttft_p95", "rps", "wall_s"):
        m[k] = statistics.median(r[k] for r in runs)
    m["per_replica"] = [int(statistics.median(r["per_replica"][i] for r in runs))
                        for i in range(len(runs[0]["per_replica"]))]  # fmt: skip
    return m


def spread_of(m: dict) -> str:
    """How far apart a policy's runs came out (--repeat): a difference smaller than this
    between two policies is not one."""
    runs = m["runs"]
    p50 = [r["ttft_p50"] * 1000 for r in runs]
    p95 = [r["ttft_p95"] * 1000 for r in runs]
    tokens = [r["prompt_n"] for r in runs]
    return (f"- {m['policy']}, {len(runs)} runs: TTFT p50 {min(p50):.0f}-{max(p50):.0f} ms, "
            f"p95 {min(p95):.0f}-{max(p95):.0f} ms, prompt tokens {min(tokens):,}-"
            f"{max(tokens):,}")  # fmt: skip


def row(m: dict) -> str:
    return (
        f"| {m['policy']} | {m['requests']} | {m['prompt_n']:,} | {m['scraped']:,} "
        f"| {' / '.join(f'{x:,}' for x in m['per_replica'])} | {m['prompt_tokens']:,} "
        f"| {m['ttft_p50'] * 1000:.0f} | {m['ttft_p95'] * 1000:.0f} | {m['rps']:.2f} "
        f"| {m['holds']} |"
    )


HEAD = (
    "| policy | requests | prompt tokens evaluated (Σ timings.prompt_n) "
    "| llamacpp:prompt_tokens_total | per replica | prompt tokens sent | TTFT p50 ms "
    "| TTFT p95 ms | req/s | held |\n|---|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--cache-ram", type=int, default=None,
                        help="llama-server --cache-ram MiB (default: its own)")  # fmt: skip
    parser.add_argument("--groups", type=int, default=GROUPS)
    parser.add_argument("--per-group", type=int, default=PER_GROUP)
    parser.add_argument("--no-controls", action="store_true")
    parser.add_argument("--no-pair", action="store_true",
                        help="leave out the two routers behind a load balancer")  # fmt: skip
    parser.add_argument("--out", default="ROUTING.md", help="the report, in bench/")
    parser.add_argument("--only", action="append", default=[],
                        help=f"run only these (round-robin, least-outstanding, prefix, {NO_HOLD},"
                             " vllm-router, sglang-router, pair-least-outstanding,"
                             " pair-prefix); no gates")  # fmt: skip
    parser.add_argument("--probe-s", type=float, default=None,
                        help="the routers' router.engine_probe_s (default: theirs)")  # fmt: skip
    parser.add_argument("--no-share", action="store_true",
                        help="the pair's prefix routers do not tell each other what they "
                             "sent where (router.prefix_share, router.prefix_peers)")  # fmt: skip
    parser.add_argument("--hold-s", type=float, default=None,
                        help="the routers' router.prefix_hold_s (default: theirs)")  # fmt: skip
    parser.add_argument("--alpha", type=float, default=None,
                        help="the routers' router.prefix_alpha (default: theirs)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each policy this many times, interleaved; the report "
                             "gives medians and the spread")  # fmt: skip
    parser.add_argument("--trace", action="store_true",
                        help="routers log each prefix choice and outcome (router.log)")  # fmt: skip
    parser.add_argument("--no-swa-full", action="store_true",
                        help="engines without --swa-full (the agent passes it)")  # fmt: skip
    parser.add_argument("--engine-arg", action="append", default=[],
                        help="one more llama-server argument for every replica")  # fmt: skip
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")
    global EXTRA, LOG_LEVEL, SHARE, SWA_FULL
    ENGINE_ARGS.extend(args.engine_arg)
    SWA_FULL = not args.no_swa_full
    if args.trace:
        LOG_LEVEL = "debug"
    if args.probe_s is not None:
        EXTRA += f"engine_probe_s = {args.probe_s}\n"
    if args.alpha is not None:
        EXTRA += f"prefix_alpha = {args.alpha}\n"
    if args.hold_s is not None:
        EXTRA += f"prefix_hold_s = {args.hold_s}\n"
    SHARE = not args.no_share
    shutil.rmtree(WORK_DIR, ignore_errors=True)
    WORK_DIR.mkdir(parents=True)
    engine_key = secrets.token_urlsafe(24)
    key_file = WORK_DIR / "engine.key"
    key_file.write_text(engine_key + "\n")
    t_start = time.time()
    load_before = os.getloadavg()[0]

    main_convs = conversations(args.turns, args.groups, args.per_group)
    only = set(args.only)

    def one_run(policy: str, routers: int = 1) -> dict:
        m = run_policy(policy, main_convs, key_file, engine_key, args.cache_ram, routers)
        if routers > 1:
            m["policy"] = f"two routers, {policy}"
        print(row(m), flush=True)
        if args.trace and policy == "prefix":
            print(where_turns_went(policy, routers), flush=True)
        return m

    measured = interleaved(tuple(p for p in (*POLICIES, *PEERS, NO_HOLD) if p in only or
                                 (not only and p != NO_HOLD)), args.repeat,
                           one_run)  # fmt: skip
    controls = []
    if not args.no_controls and not only:
        unique = conversations(1, groups=1, per_group=12, unique=True)
        for policy in ("least-outstanding", "prefix"):
            m = run_policy(policy, unique, key_file, engine_key, args.cache_ram)
            m["policy"] = f"unique prompts, {policy}"
            controls.append(m)
            print(row(m), flush=True)
        hot = conversations(args.turns, groups=1, per_group=8, hot=True)
        m = run_policy("prefix", hot, key_file, engine_key, args.cache_ram)
        m["policy"] = "one hot group, prefix"
        controls.append(m)
        print(row(m), flush=True)
    pair = {}
    if not args.no_pair:
        both = ("least-outstanding", "prefix")
        pair = interleaved(tuple(p for p in both if not only or f"pair-{p}" in only),
                           args.repeat, lambda policy: one_run(policy, routers=2))  # fmt: skip
    spread = [spread_of(m) for m in (*measured.values(), *pair.values()) if "runs" in m]
    if spread:
        print("\n".join(spread), flush=True)

    if only:
        return
    rr, lo, px = measured["round-robin"], measured["least-outstanding"], measured["prefix"]
    ratio = px["prompt_n"] / rr["prompt_n"] if rr["prompt_n"] else float("nan")
    gates = [
        (f"prefix evaluates ≤ 0.6× round-robin's prompt tokens: {ratio:.2f}×", ratio <= 0.6),
        (
            f"prefix TTFT p50 better than least-outstanding: {px['ttft_p50'] * 1000:.0f} ms vs "
            f"{lo['ttft_p50'] * 1000:.0f} ms",
            px["ttft_p50"] < lo["ttft_p50"],
        ),  # fmt: skip
        (
            f"prefix TTFT p95 within +10% of least-outstanding: {px['ttft_p95'] * 1000:.0f} ms vs "
            f"{lo['ttft_p95'] * 1000:.0f} ms",
            px["ttft_p95"] <= 1.10 * lo["ttft_p95"],
        ),  # fmt: skip
    ]
    for name in PEERS:  # the bar: 20% better TTFT, no more tokens than the better
        peer = measured[name]
        for q in ("p50", "p95"):
            mine, theirs = px[f"ttft_{q}"], peer[f"ttft_{q}"]
            gates.append((f"prefix TTFT {q} at least 20% better than {name} (cache_aware): "
                          f"{mine * 1000:.0f} ms vs {theirs * 1000:.0f} ms "
                          f"({mine / theirs - 1:+.0%})", mine <= 0.8 * theirs))  # fmt: skip
    fewest = min(measured[name]["prompt_n"] for name in PEERS)
    gates.append((f"prefix evaluates no more prompt tokens than the better peer: "
                  f"{px['prompt_n']:,} vs {fewest:,}", px["prompt_n"] <= fewest))  # fmt: skip
    if controls:
        ul, up = controls[0], controls[1]
        slower = up["ttft_p50"] / ul["ttft_p50"] - 1
        gates.append((f"unique prompts: prefix TTFT p50 {slower:+.0%} against least-outstanding"
                      " (no regression over 5%)", slower <= 0.05))  # fmt: skip
        hot_m = controls[2]
        share = min(hot_m["per_replica"]) / max(1, max(hot_m["per_replica"]))
        gates.append((f"one hot group: the less used replica evaluated {share:.0%} as many "
                      "prompt tokens as the other (both busy)", share > 0))  # fmt: skip
    if pair:
        plo, ppx = pair["least-outstanding"], pair["prefix"]
        gates.append((f"two routers: prefix evaluates fewer prompt tokens than least-outstanding:"
                      f" {ppx['prompt_n']:,} vs {plo['prompt_n']:,}",
                      ppx["prompt_n"] < plo["prompt_n"]))  # fmt: skip
        gates.append((f"two routers: prefix TTFT p50 better than least-outstanding: "
                      f"{ppx['ttft_p50'] * 1000:.0f} ms vs {plo['ttft_p50'] * 1000:.0f} ms",
                      ppx["ttft_p50"] < plo["ttft_p50"]))  # fmt: skip

    ram = "the engine's default (8 GiB)" if args.cache_ram is None else f"{args.cache_ram} MiB"
    took = time.time() - t_start
    lines = [
        "# Routing: round-robin, least-outstanding and prefix-aware, beside vllm-router and"
        " sglang-router (cache_aware)",
        "",
        f"Run {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by `bench/routing.py` in {took:.0f} s. "
        f"Two llama-server replicas of {MODEL} (Q4_K_M), each pinned to one core, `-t 1 -np 2 "
        f"-c 8192{''.join(' ' + a for a in ['--swa-full'] * SWA_FULL + ENGINE_ARGS)}`, "
        f"`--cache-ram` {ram}; "
        f"{args.groups} groups × {args.per_group} "
        f"conversations × {args.turns} turns sharing a system prompt per group, closed loop "
        f"at concurrency {CONCURRENCY}, `max_tokens` {MAX_TOKENS}, "
        f"seed {SEED}, streamed. The peers: {peer_versions()}, `--policy cache_aware` with"
        " their default thresholds. Each policy starts with fresh engines (cold caches)"
        + (
            f", {args.repeat} runs each, interleaved; figures are their medians"
            if args.repeat > 1
            else ""
        )
        + (
            ". The pair's prefix routers tell each other what they sent where"
            " (`router.prefix_peers`)"
            if SHARE
            else ". The pair's routers share nothing (`--no-share`)"
        )
        + ". Load"
        f" average {load_before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end on"
        f" {os.cpu_count()} cores (the engines, router and client take about two: more"
        " means other work shared the cores, and times are noisy). Token counts vary"
        " between runs too: what each engine's cache holds depends on how requests"
        " interleave.",
        "",
        HEAD,
        *(row(m) for m in measured.values()),
        *(row(m) for m in controls),
        *(row(m) for m in pair.values()),
        "",
        *(["Medians of the runs; how far apart they came out:", "", *spread, ""] if spread else []),
        "## Gates",
        "",
        *(f"- {'holds' if ok else 'FAILS'}: {text}" for text, ok in gates),
        "",
    ]
    (Path(__file__).parent / args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
