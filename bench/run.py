"""Benchmark llmgw-router side by side with direct access, nginx, the Rust routers
(vllm-router, sglang-router) and LiteLLM.

    .venv/bin/python bench/run.py [--peers nginx,vllm-router] [--baseline REV] [--profile]
    make bench BASE=REV                   # the same, every peer
    .venv/bin/python bench/run.py --smoke # every target started and measured briefly

All targets sit in front of the same fast fake engine (bench/fake_engine.py) and are
measured one after another in one run, against the direct baseline of that run. The
proxy under test runs on CPU 1; the engine and the load generators share CPU 0.
Prints a table and writes bench/RESULTS.md (and bench/PROFILE.md with --profile).
"""

import argparse
import asyncio
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import loadgen
import profiling
import targets
import uvloop
from targets import WORK, Skip

HOST = "127.0.0.1"
CHUNKS = 20
# Each phase stops at a request count or a time limit, whichever comes first.
WARMUP_N, WARMUP_S = 300, 3
LATENCY_N, LATENCY_S = 2000, 6  # concurrency 1
# p99 under concurrent load (issue #35's bar). Enough requests that every window holds a
# few of the usage writer's flushes (one a second): with 4000 (half a second of llmgw)
# p99 went from 2.5 to 6 ms and back, as a flush fell inside the window or not.
TAIL_N, TAIL_S, TAIL_C = 20000, 6, 16
CPU_N, CPU_S, CPU_C = 8000, 6, 8
CPU_ROUNDS = 3  # CPU windows per target; the table gives their median
# The limits bar is judged side by side: both routers up, windows of each taken in turn
# (the order turned every pair), the median of the pairs' ratios. Measured one after the
# other, minutes apart, the same two builds came out +21% in one run and +45% in the
# next: this VM's speed drifts by more than the bar.
PAIRS = 9
STREAM_N, STREAM_S = 1000, 8  # concurrency 1
WRK_S, WRK_C = 5, 8
PROFILE_S = 8

# Issue #35's bars, which replace issue #12's absolute ones (60 µs a request, 180 µs a
# stream, +0.15 ms p50, 15 µs a paced chunk): CPU per request no more than the baseline
# revision's, side by side (--baseline); CPU per stream no more than vllm-router's and
# p99 at concurrency 16 within 1.3× its, in the same run. Issue #5's limits bar stays.
BAR = {"baseline_req": 1.05, "vllm_stream": 1.0, "vllm_p99_c16": 1.3, "limits_growth": 0.20}
# Paced streams: the engine sends each chunk PACED_GAP_MS after the last, so every one
# wakes the proxy by itself (an engine decoding in real time does that).
PACED_GAP_MS, PACED_N, PACED_S, IDLE_S = 2.0, 150, 8, 2.0
# After a load phase, the target's CPU is looked at every SETTLE_S until it is idle again.
SETTLE_S, SETTLE_MAX_S = 0.25, 5.0


@dataclass
class Measured:
    name: str
    label: str
    version: str = ""
    skipped: str = ""
    rps: float = float("nan")
    wrk_p50_ms: float = float("nan")
    wrk_p99_ms: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    p99_c16_ms: float = float("nan")
    mean_c16_ms: float = float("nan")
    cpu_req_us: float | None = None
    cpu_stream_us: float | None = None
    ttfb_ms: float = float("nan")
    notes: list[str] = field(default_factory=list)


# --- measuring ---------------------------------------------------------------------------


class Bench:
    def __init__(self, runner: asyncio.Runner, load_cpu: int | None):
        self.runner, self.load_cpu = runner, load_cpu
        self.wrk_script = WORK / "chat.lua"
        self.wrk_script.write_text(WRK_LUA.format(body=loadgen.chat_body(False).decode()))

    def load(self, target, stream: bool, count: int, conc: int, max_s: float):
        body = loadgen.chat_body(stream)
        raw = loadgen.raw_request(HOST, target.port, loadgen.CHAT_PATH, body, target.api_key)
        return self.runner.run(loadgen.run(HOST, target.port, raw, count, conc, max_s, stream))

    def with_cpu(self, target, stream: bool, count: int, conc: int, max_s: float,
                 idle_per_s: float | None = None):  # fmt: skip
        """A load phase and the CPU time the target's processes spent on it (ns).

        With `idle_per_s` (the target's CPU idle, from idle_rate), the count goes on
        after the load until the target is idle again, less idle_per_s over the whole
        time: work the load left behind (the router's usage writer inserts the rows a
        second later) counts for the load that made it, not for the next phase."""
        pids = target.pids()
        before, t0 = targets.cpu_ns(pids), time.monotonic()
        result = self.load(target, stream, count, conc, max_s)
        if idle_per_s is None:
            return result, targets.cpu_ns(pids) - before
        after = self.settled(pids, idle_per_s)
        return result, max(0.0, after - before - idle_per_s * (time.monotonic() - t0))

    @staticmethod
    def settled(pids, idle_per_s: float) -> int:
        """The processes' CPU (ns) once a SETTLE_S look finds them no busier than idle
        (give or take 1 ms), or after SETTLE_MAX_S."""
        deadline = time.monotonic() + SETTLE_MAX_S
        last = targets.cpu_ns(pids)
        while time.monotonic() < deadline:
            time.sleep(SETTLE_S)
            now = targets.cpu_ns(pids)
            if now - last <= idle_per_s * SETTLE_S + 1e6:
                return now
            last = now
        return last

    def idle_rate(self, target) -> float:
        """The target's CPU (ns a second) with nothing to do: its timers and threads."""
        pids = target.pids()
        self.settled(pids, 0.0)
        before = targets.cpu_ns(pids)
        time.sleep(IDLE_S)
        return (targets.cpu_ns(pids) - before) / IDLE_S

    def front_door(self, target) -> list[str]:
        """CPU per request of a chat completion, a Messages call the engine serves itself
        and one translated to chat, through one router, one after another."""
        phases = [
            ("chat completion", loadgen.CHAT_PATH, loadgen.chat_body(False)),
            ("Messages, native", "/v1/messages", loadgen.messages_body(targets.MODEL)),
            ("Messages, translated", "/v1/messages",
             loadgen.messages_body(targets.FrontDoorRouter.TRANSLATED_MODEL)),
        ]  # fmt: skip
        spent = {}
        for what, path, body in phases:
            raw = loadgen.raw_request(HOST, target.port, path, body, target.api_key)
            run = loadgen.run(HOST, target.port, raw, WARMUP_N, CPU_C, WARMUP_S)
            self.runner.run(run)
            before = targets.cpu_ns(target.pids())
            r = self.runner.run(loadgen.run(HOST, target.port, raw, CPU_N, CPU_C, CPU_S))
            ns = targets.cpu_ns(target.pids()) - before
            if r.errors or not r.ok:
                return [f"front door: {what} failed: {r.first_error}"]
            spent[what] = ns / r.ok / 1e3
        base = spent["chat completion"]
        return [
            f"CPU per request, {what}: {us:.0f} µs ({us / base:.2f}× a chat completion)"
            for what, us in spent.items()
        ]

    def paced(self, target) -> float | None:
        """CPU µs per separately arriving chunk: streams from an engine that sends its
        chunks PACED_GAP_MS apart, less what the proxy spends idle over as long (its
        timers and threads), divided by the pieces that arrive by themselves (CHUNKS
        events, then usage and [DONE])."""
        self.wait_working(target)
        self.load(target, True, 20, 1, WARMUP_S)
        idle_per_s = self.idle_rate(target)
        r, ns = self.with_cpu(target, True, PACED_N, 1, PACED_S, idle_per_s)
        if r.errors or not r.ok:
            return None
        return ns / r.ok / (CHUNKS + 1) / 1e3

    def side_by_side(self, base, other) -> list[float]:
        """`other`'s CPU per request over `base`'s, PAIRS times: both running, each pair
        of windows counted as with_cpu counts one, the order turned every pair."""
        idle = {}
        for t in (base, other):
            self.wait_working(t)
            self.load(t, False, WARMUP_N, CPU_C, WARMUP_S)
            idle[t] = self.idle_rate(t)
        ratios = []
        for i in range(PAIRS):
            spent = {}
            for t in (base, other) if i % 2 == 0 else (other, base):
                r, ns = self.with_cpu(t, False, CPU_N, CPU_C, CPU_S, idle[t])
                if r.errors or not r.ok:
                    raise Skip(f"{t.name}: {r.errors} errors ({r.first_error})")
                spent[t] = ns / r.ok / 1e3
            ratios.append(spent[other] / spent[base])
        return ratios

    def wait_working(self, target, timeout_s: float = 15) -> None:
        """Until a request succeeds (a new API key takes the router up to ~2 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.load(target, False, 1, 1, 5)
            if result.errors == 0:
                return
            if time.monotonic() > deadline or not target.alive():
                raise Skip(f"requests keep failing: {result.first_error}")
            time.sleep(0.3)

    def measure(self, target) -> Measured:
        m = Measured(target.name, target.label, target.version)

        def say(what: str) -> None:
            print(f"  {target.name}: {what}", flush=True)

        self.wait_working(target)
        say("warming up")
        self.load(target, False, WARMUP_N, CPU_C, WARMUP_S)
        self.load(target, True, WARMUP_N // 10, 2, WARMUP_S)

        say(f"latency at concurrency 1 (≤{LATENCY_N} requests, ≤{LATENCY_S}s)")
        r = self.load(target, False, LATENCY_N, 1, LATENCY_S)
        self.check(m, "latency", r)
        m.p50_ms = loadgen.percentile(r.latencies, 50) * 1e3
        m.p99_ms = loadgen.percentile(r.latencies, 99) * 1e3

        say(f"latency at concurrency {TAIL_C} (≤{TAIL_N} requests, ≤{TAIL_S}s)")
        r = self.load(target, False, TAIL_N, TAIL_C, TAIL_S)
        self.check(m, f"latency c={TAIL_C}", r)
        if r.latencies:
            m.p99_c16_ms = loadgen.percentile(r.latencies, 99) * 1e3
            m.mean_c16_ms = statistics.fmean(r.latencies) * 1e3

        # CPU in CPU_ROUNDS windows each, requests and streams taken in turn, each
        # counted until the target is idle again, and the median kept: one window of a
        # few thousand requests, counted as its load ended, moved by a quarter from run
        # to run, as the usage writer's inserts for it fell inside it or in the next.
        say(f"CPU per request at concurrency {CPU_C} (≤{CPU_N} requests, ≤{CPU_S}s) and "
            f"streams of {CHUNKS} chunks at concurrency 1 (≤{STREAM_N}, ≤{STREAM_S}s), "
            f"{CPU_ROUNDS} times")  # fmt: skip
        idle_per_s = self.idle_rate(target)
        per_req, per_stream, ttfbs = [], [], []
        for _ in range(CPU_ROUNDS):
            r, ns = self.with_cpu(target, False, CPU_N, CPU_C, CPU_S, idle_per_s)
            self.check(m, "cpu", r)
            if r.ok:
                per_req.append(ns / r.ok / 1e3)
            r, ns = self.with_cpu(target, True, STREAM_N, 1, STREAM_S, idle_per_s)
            self.check(m, "streams", r)
            ttfbs += r.ttfbs
            if r.ok:
                per_stream.append(ns / r.ok / 1e3)
        if ttfbs:
            m.ttfb_ms = loadgen.percentile(ttfbs, 50) * 1e3
        if target.is_proxy and per_req and per_stream:
            m.cpu_req_us = statistics.median(per_req)
            m.cpu_stream_us = statistics.median(per_stream)
            m.notes.append(
                f"CPU µs/req in {len(per_req)} windows {min(per_req):,.0f}–{max(per_req):,.0f}"
                f", µs/stream {min(per_stream):,.0f}–{max(per_stream):,.0f} (medians in the table)"
            )

        say(f"throughput with wrk, {WRK_C} connections for {WRK_S}s")
        before = targets.cpu_ns(target.pids())
        out = self.wrk(target, WRK_S)
        if target.is_proxy and out["requests"]:
            ns = targets.cpu_ns(target.pids()) - before
            m.notes.append(
                f"under wrk: {ns / out['requests'] / 1e3:,.0f} CPU µs/req, "
                f"{ns / 1e9 / out['seconds']:.0%} of a core"
            )
        m.rps, m.wrk_p50_ms, m.wrk_p99_ms = out["rps"], out["p50_ms"], out["p99_ms"]
        if out["problems"]:
            m.notes.append(f"wrk: {out['problems']}")
        if not target.alive():
            m.notes.append("the process died during the run")
        return m

    @staticmethod
    def check(m: Measured, phase: str, r: loadgen.Result) -> None:
        if r.errors:
            m.notes.append(f"{phase}: {r.errors}/{r.requests} failed, first: {r.first_error}")

    def wrk(self, target, seconds: float) -> dict:
        url = f"http://{HOST}:{target.port}{loadgen.CHAT_PATH}"
        cmd = ["wrk", "-t1", f"-c{WRK_C}", f"-d{seconds}s", "--latency", "-s",
               str(self.wrk_script), url]  # fmt: skip
        if target.api_key:
            cmd += ["-H", f"Authorization: Bearer {target.api_key}"]
        out = subprocess.run(
            targets.pinned(cmd, self.load_cpu), capture_output=True, text=True,
            timeout=seconds + 30, env=targets.clean_env(),
        )  # fmt: skip
        return parse_wrk(out.stdout + out.stderr)

    def profile(self, target) -> tuple[int, list[tuple[str, int]]] | str:
        """Sample the target with py-spy under the wrk load; its top functions, or why not."""
        raw, log = WORK / "profile.raw.txt", WORK / "py-spy.log"
        raw.unlink(missing_ok=True)
        try:
            spy = profiling.record(target.pid, PROFILE_S, raw, log)
        except (OSError, subprocess.CalledProcessError) as e:
            return f"py-spy unavailable: {e}"
        try:
            time.sleep(0.5)  # let py-spy attach
            self.wrk(target, PROFILE_S + 1)
            spy.wait(PROFILE_S + 30)
        finally:
            targets.stop(spy)
        if spy.returncode != 0 or not raw.exists():
            return f"py-spy failed (exit {spy.returncode}):\n{targets.log_tail(log, 5)}"
        return profiling.own_time(raw)


WRK_LUA = """\
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{body}'
"""


def parse_wrk(text: str) -> dict:
    def ms(value: str, unit: str) -> float:
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]

    found = re.search(r"Requests/sec:\s*([\d.]+)", text)
    out = {"rps": float(found.group(1)) if found else float("nan")}
    found = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    out["requests"] = int(found.group(1)) if found else 0
    out["seconds"] = ms(*found.groups()[1:]) / 1e3 if found else float("nan")
    for pct in ("50", "99"):
        found = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
        out[f"p{pct}_ms"] = ms(*found.groups()) if found else float("nan")
    problems = []
    found = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if found:
        problems.append(f"{found.group(1)} non-2xx answers")
    found = re.search(r"Socket errors: (.*)", text)
    if found:
        problems.append(f"socket errors: {found.group(1)}")
    if not re.search(r"Requests/sec", text):
        problems.append(f"unexpected output: {text.strip()[-300:]}")
    out["problems"] = "; ".join(problems)
    return out


# --- reporting ---------------------------------------------------------------------------

COLUMNS = ["target", f"req/s c={WRK_C}", "× direct", "p50 ms c=1", "+p50 ms", "+p99 ms",
           f"p99 ms c={TAIL_C}", "CPU µs/req", "CPU µs/stream", "TTFB ms", "+TTFB ms"]  # fmt: skip


def fmt(value, spec: str, signed: bool = False) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return format(value, ("+" if signed else "") + spec)


def ratio(value: float) -> str:
    """0.37×, or two significant digits for small ratios (0.0015×)."""
    return fmt(value, ".2f" if value >= 0.1 else ".2g") + "×"


def table_rows(results: list[Measured]) -> list[list[str]]:
    base = results[0]
    rows = []
    for m in results:
        if m.skipped:
            rows.append([m.name, "skipped"] + [""] * (len(COLUMNS) - 2))
            continue
        is_base = m is base
        rows.append([
            m.name,
            fmt(m.rps, ",.0f"),
            "1.00×" if is_base else ratio(m.rps / base.rps),
            fmt(m.p50_ms, ".3f"),
            "—" if is_base else fmt(m.p50_ms - base.p50_ms, ".3f", True),
            "—" if is_base else fmt(m.p99_ms - base.p99_ms, ".3f", True),
            fmt(m.p99_c16_ms, ".3f"),
            fmt(m.cpu_req_us, ",.0f"),
            fmt(m.cpu_stream_us, ",.0f"),
            fmt(m.ttfb_ms, ".3f"),
            "—" if is_base else fmt(m.ttfb_ms - base.ttfb_ms, ".3f", True),
        ])  # fmt: skip
    return rows


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS))]

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) for c, w in zip(cells, widths, strict=True)]
        padded[0] = cells[0].ljust(widths[0])
        return "  ".join(padded)

    return "\n".join([line(COLUMNS), "  ".join("-" * w for w in widths), *map(line, rows)])


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|---" + "|--:" * (len(COLUMNS) - 1) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def notes(results: list[Measured]) -> list[str]:
    out = []
    for m in results:
        what = m.label + (f" {m.version}" if m.version else "")
        if m.skipped:
            out.append(f"{m.name}: skipped: {m.skipped}")
            continue
        extra = [f"wrk p50/p99 {m.wrk_p50_ms:.3f}/{m.wrk_p99_ms:.3f} ms", *m.notes]
        out.append(f"{m.name}: {what}; " + "; ".join(extra))
    return out


def bar_check(results: list[Measured], paced: dict | None = None,
              paired: dict | None = None, baseline: tuple | None = None) -> list[str]:  # fmt: skip
    """llmgw's verdicts and comparisons. `baseline`: (revision, [CPU per request ratios,
    now over then, side by side]) from --baseline."""
    router = next((m for m in results if m.name == "llmgw" and not m.skipped), None)
    if router is None:
        return []
    paced = paced or {}
    out = []
    if baseline is not None:
        rev, ratios = baseline
        grew = statistics.median(ratios)
        verdict = "meets" if grew <= BAR["baseline_req"] else "MISSES"
        out.append(
            f"CPU per request against {rev}, side by side: {grew:.2f}×, the median of "
            f"{len(ratios)} pairs of windows ({min(ratios):.2f}× to {max(ratios):.2f}×) "
            f"(bar ≤{BAR['baseline_req']:.2f}×): {verdict}"
        )
    else:
        out.append("CPU per request against the baseline revision: n/a (run with --baseline REV)")
    vllm = next((m for m in results if m.name == "vllm-router" and not m.skipped), None)
    checks = [
        (f"CPU per {CHUNKS}-chunk stream", "µs", ".0f", "vllm_stream",
         router.cpu_stream_us, vllm.cpu_stream_us if vllm else None),
        (f"p99 at concurrency {TAIL_C}", "ms", ".2f", "vllm_p99_c16",
         router.p99_c16_ms, vllm.p99_c16_ms if vllm else None),
    ]  # fmt: skip
    for what, unit, spec, bar, ours, theirs in checks:
        if not (ours and theirs) or ours != ours or theirs != theirs:
            out.append(f"{what} against vllm-router's: n/a (not measured in this run)")
            continue
        verdict = "meets" if ours <= theirs * BAR[bar] else "MISSES"
        out.append(f"{what} against vllm-router's: {fmt(ours, spec)} {unit} against "
                   f"{fmt(theirs, spec)} {unit}, {ours / theirs:.2f}× (bar ≤{BAR[bar]:.2f}×): "
                   f"{verdict}")  # fmt: skip
    if vllm is not None and router.mean_c16_ms == router.mean_c16_ms:
        # On one core, c requests at once wait for each other: the mean is about c times
        # what a request costs, so a tail within 1.3× of a router that costs half as much
        # needs both a flat tail and the cost.
        out.append(f"mean latency at concurrency {TAIL_C}: {router.mean_c16_ms:.2f} ms against "
                   f"vllm-router's {vllm.mean_c16_ms:.2f} ms; p99 over the mean "
                   f"{router.p99_c16_ms / router.mean_c16_ms:.2f} against "
                   f"{vllm.p99_c16_ms / vllm.mean_c16_ms:.2f}")  # fmt: skip
    add_p50 = router.p50_ms - results[0].p50_ms
    out.append(f"added p50 latency at c=1: {fmt(add_p50, '.3f')} ms")
    if "llmgw" in paced:
        out.append(f"CPU per separately arriving chunk ({PACED_GAP_MS:g} ms apart): "
                   f"{fmt(paced['llmgw'], '.0f')} µs")  # fmt: skip
    if paced.get("llmgw") and paced.get("nginx"):
        ours, theirs = paced["llmgw"], paced["nginx"]
        out.append(f"CPU per separately arriving chunk against nginx's: {ours:.0f} µs "
                   f"against {theirs:.0f} µs, {ours / theirs:.1f}×")  # fmt: skip
    for peer in ("nginx", "vllm-router", "sglang-router"):
        m = next((m for m in results if m.name == peer and not m.skipped), None)
        if m is None or not (router.cpu_req_us and m.cpu_req_us):
            continue
        line = f"CPU per request against {peer}'s: {router.cpu_req_us / m.cpu_req_us:.2f}×"
        if router.cpu_stream_us and m.cpu_stream_us:
            line += f", per stream {router.cpu_stream_us / m.cpu_stream_us:.2f}×"
        if router.p99_c16_ms == router.p99_c16_ms and m.p99_c16_ms == m.p99_c16_ms:
            line += f", p99 at c={TAIL_C} {router.p99_c16_ms / m.p99_c16_ms:.2f}×"
        out.append(line)
    old = next((m for m in results if m.name == "llmgw-aiohttp" and not m.skipped), None)
    if old is not None and router.cpu_req_us and old.cpu_req_us:
        line = (f"CPU per request, own HTTP/1.1 server against aiohttp's (router.transport): "
                f"{router.cpu_req_us:.0f} µs against {old.cpu_req_us:.0f} µs, "
                f"{router.cpu_req_us / old.cpu_req_us:.2f}×")  # fmt: skip
        new_s, old_s = router.cpu_stream_us, old.cpu_stream_us
        if new_s and old_s:
            line += f"; per stream {new_s:.0f} µs against {old_s:.0f} µs, {new_s / old_s:.2f}×"
        out.append(line)
    nospool = next((m for m in results if m.name == "llmgw-nospool" and not m.skipped), None)
    if nospool is not None and router.cpu_req_us and nospool.cpu_req_us:
        on, off = router.cpu_req_us, nospool.cpu_req_us
        line = f"CPU per request with the usage spool: {on:.0f} µs against {off:.0f} µs off, "
        line += f"{on / off:.2f}×"
        if router.cpu_stream_us and nospool.cpu_stream_us:
            on, off = router.cpu_stream_us, nospool.cpu_stream_us
            line += f"; per stream {on:.0f} µs against {off:.0f} µs, {on / off:.2f}×"
        out.append(line)
    for name, what in (("llmgw+limits", "limits, budgets and a band on the key"),
                       ("llmgw+limits*5", "limits on every level as well")):  # fmt: skip
        limited = next((m for m in results if m.name == name and not m.skipped), None)
        if limited is None or not (router.cpu_req_us and limited.cpu_req_us):
            continue
        grew = limited.cpu_req_us / router.cpu_req_us - 1
        out.append(
            f"CPU per request with {what}, one after the other: {limited.cpu_req_us:.0f} µs "
            f"against {router.cpu_req_us:.0f} µs without, {grew:+.0%}"
        )
    for name, ratios in (paired or {}).items():
        what = "limits on every level" if name.endswith("*5") else "limits, budgets and a band"
        grew = statistics.median(ratios) - 1
        verdict = "meets" if grew <= BAR["limits_growth"] else "MISSES"
        out.append(
            f"CPU per request with {what}, side by side: {grew:+.0%}, the median of "
            f"{len(ratios)} pairs of windows ({min(ratios) - 1:+.0%} to {max(ratios) - 1:+.0%}) "
            f"(bar ≤+{BAR['limits_growth']:.0%}): {verdict}"
        )
    return out


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({model}), Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def write_results(
    path: Path,
    results,
    rows,
    pinning: str,
    when: str,
    gap_ms: float,
    front=(),
    paced=None,
    paired=None,
    baseline=None,
) -> None:
    pacing = f"{gap_ms:g} ms apart" if gap_ms else "each its own write, back to back"
    verdicts = bar_check(results, paced, paired, baseline)
    text = f"""# Benchmark: llmgw-router and its peers

Generated by `make bench` (`bench/run.py`) on {when}.

Machine: {machine()}. {pinning}

{markdown_table(rows)}

{chr(10).join("- " + n for n in notes(results))}

llmgw-router against its bar:

{chr(10).join("- " + c for c in verdicts) or "- (router not measured)"}

The front door (`llmgw-frontdoor`: one router, model `bench` on an engine that serves
Anthropic's Messages itself, `bench-chat` on one that serves only chat, so the router
translates), non-streaming, at concurrency {CPU_C}:

{chr(10).join("- " + f for f in front) or "- (not measured)"}

## Method

All targets forward to the same fake engine (`bench/fake_engine.py`, raw uvloop
Protocols: a fixed JSON answer with `usage`, or {CHUNKS} SSE chunks ({pacing}), then a
usage chunk and `[DONE]`), one target at a time, and every figure is compared
with the direct baseline of the same run. `direct` is the engine itself; `nginx` a
plain reverse proxy (1 worker, upstream keep-alive, `proxy_buffering off`);
`vllm-router` and `sglang-router` the Rust routers a user would put in front of vLLM
instead (their PyPI wheels, `--policy round_robin` over the one engine, bound to
127.0.0.1, as shipped otherwise: both log each request at their default level); `litellm`
LiteLLM's proxy with the engine as an `openai/` model; `llmgw` llmgw-router with API
keys, usage recording into a SQLite store (through its spool on local disk) and
Prometheus metrics on; `llmgw-nospool` the same with `router.usage_spool = false`; `llmgw+limits`
the same router with the bench key belonging to a user and a project of an org, with
rpm, tpm and concurrent limits, a token budget per day, a cost budget per month and a
band on the key, and prices and slots on the model, all far above what the run uses,
so every request is reserved, settled, priced and admitted through them
(`--every-level` adds `llmgw+limits*5`, with rpm and tpm limits on the user, project,
team and org as well).

- req/s: `wrk -t1 -c{WRK_C} -d{WRK_S}s`, non-streaming chat completions.
- p50/p99 at c=1: up to {LATENCY_N} sequential requests (≤{LATENCY_S} s) on one keep-alive
  connection from a raw-asyncio client; `+` columns are the difference from direct.
- p99 at c={TAIL_C}: up to {TAIL_N} requests (≤{TAIL_S} s) over {TAIL_C} keep-alive
  connections from the same client.
- Against the baseline revision (`--baseline REV`, when given): REV's router started
  beside this checkout's and measured side by side as the limits are (below).
- CPU µs/req: user+system CPU of the proxy's process tree (all threads, from
  `/proc/PID/task/*/schedstat`) over up to {CPU_N} requests at concurrency {CPU_C}
  (≤{CPU_S} s), counted on until the proxy is idle again (≤{SETTLE_MAX_S:g} s more: the
  router's usage writer inserts a load's rows after it) less the proxy's idle CPU over
  the whole time (measured for {IDLE_S:g} s before), divided by the requests answered;
  the median of {CPU_ROUNDS} such windows (their range is in the notes).
- Limits against none, side by side: `llmgw` and `llmgw+limits` started again together
  (both on the proxy's CPU, one idle while the other is measured), {PAIRS} pairs of
  windows counted as above, one of each in turn, the order turned every pair; the bar
  is judged on the median of the pairs' ratios. The table's figures, measured minutes
  apart, move with the VM's speed by more than the bar.
- CPU µs/stream and TTFB: the same over up to {STREAM_N} sequential streamed requests
  (≤{STREAM_S} s), a window after each window of requests; TTFB is the time to the first
  body chunk (p50 of all the streams).
- CPU per separately arriving chunk: llmgw and nginx again, in front of a second fake
  engine that sends each chunk {PACED_GAP_MS:g} ms after the last, over up to {PACED_N}
  sequential streams (≤{PACED_S} s), counted as CPU µs/req is, divided by the
  {CHUNKS + 1} pieces that arrive by themselves. Every piece wakes the proxy from its
  event loop's wait, which on this VM costs more than the relaying (compare nginx).
- The proxy is pinned to CPU 1 (`taskset`), the engine, wrk and the Python load
  generator to CPU 0, so the proxy's CPU is its own; req/s can be capped by CPU 0.
"""
    path.write_text(text)


def write_profile(path: Path, profile, when: str) -> str:
    if isinstance(profile, str):
        body = profile
    else:
        total, top = profile
        lines = ["| own samples | % | function |", "|--:|--:|---|"]
        lines += [f"| {n} | {100 * n / total:.1f} | `{fn}` |" for fn, n in top]
        body = f"{total} samples in all.\n\n" + "\n".join(lines)
    path.write_text(
        f"# Profile: llmgw-router under load\n\nGenerated by `bench/run.py --profile` on {when}:"
        f" py-spy at 500 Hz (`--nonblocking`, idle threads excluded) for {PROFILE_S} s while"
        f" wrk sends non-streaming requests over {WRK_C} connections. Functions by own time"
        f" (the leaf frame of each sample); time in C code, uvloop's loop and system calls"
        f" included, counts against the Python frame that called it (`run_app` is the event"
        f" loop itself).\n\nMachine: {machine()}.\n\n{body}\n"
    )
    if isinstance(profile, str):
        return profile
    total, top = profile
    return "\n".join(f"{n:7d} {100 * n / total:5.1f}%  {fn}" for fn, n in top)


# --- main --------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(
        description="Benchmark llmgw-router against direct access and peer proxies."
    )
    parser.add_argument(
        "--peers", default=",".join(targets.PEERS),
        help=f"comma-separated peers to measure besides direct and llmgw: "
             f"{', '.join(targets.PEERS)} (default: all; '' for none)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", metavar="REV",
        help="also run llmgw-router as it was at git revision REV side by side with this "
             "checkout, for the CPU-per-request bar (e.g. the commit a change starts from)",
    )  # fmt: skip
    parser.add_argument(
        "--smoke", action="store_true",
        help="every phase a few hundred requests and a second or so, one window and one "
             "pair: proves every target starts and is measured; writes no RESULTS.md",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true", help="also sample llmgw-router with py-spy"
    )
    parser.add_argument(
        "--chunk-gap-ms", type=float, default=0.0, metavar="MS",
        help="pause between the fake engine's stream chunks (default 0: back to back; with a "
             "pause every chunk wakes the proxy, which on an idle VM costs far more CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--front-door-only", action="store_true",
        help="measure only the front door: CPU per request of a chat completion, and of "
             "Anthropic Messages native and translated, through one router",
    )  # fmt: skip
    parser.add_argument(
        "--every-level", action="store_true",
        help="also measure the router with rpm and tpm limits on the key's user, project, "
             "team and org besides the key's own limits and budgets",
    )  # fmt: skip
    args = parser.parse_args()
    args.peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in args.peers if p not in targets.PEERS]
    if unknown:
        parser.error(f"unknown peer {', '.join(unknown)}; choose from {', '.join(targets.PEERS)}")
    return args


def preflight(peers: list[str], front_door_only: bool = False) -> None:
    tools = ("taskset",) if front_door_only else ("wrk", "taskset")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if "nginx" in peers and not (shutil.which("nginx") or Path("/usr/sbin/nginx").exists()):
        missing.append("nginx")
    if missing:
        sys.exit(
            f"bench: {', '.join(missing)} not found. Install with: {targets.INSTALL_HINT}"
            + (" (taskset is in util-linux)" if "taskset" in missing else "")
            + ("; or leave nginx out with --peers litellm" if "nginx" in missing else "")
        )


def shorten() -> None:
    """--smoke: every phase a small fraction of its full length."""
    global WARMUP_N, WARMUP_S, LATENCY_N, LATENCY_S, TAIL_N, TAIL_S, CPU_N, CPU_S
    global CPU_ROUNDS, PAIRS, STREAM_N, STREAM_S, WRK_S, PACED_N, PACED_S, IDLE_S
    WARMUP_N, WARMUP_S, LATENCY_N, LATENCY_S, TAIL_N, TAIL_S = 50, 1, 200, 1, 400, 1
    CPU_N, CPU_S, CPU_ROUNDS, PAIRS, STREAM_N, STREAM_S = 400, 1, 1, 1, 50, 1
    WRK_S, PACED_N, PACED_S, IDLE_S = 1, 10, 1, 0.5


def main() -> int:
    args = parse_args()
    if args.smoke:
        shorten()
    if args.front_door_only:
        args.peers = []
    preflight(args.peers, args.front_door_only)
    WORK.mkdir(parents=True, exist_ok=True)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        load_cpu, proxy_cpu = cpus[0], cpus[1]
        os.sched_setaffinity(0, {load_cpu})  # this process is the Python load generator
        pinning = (
            f"The proxy runs on CPU {proxy_cpu}; the engine and load generators on CPU {load_cpu}."
        )
    else:
        load_cpu = proxy_cpu = None
        pinning = "Only one CPU: nothing pinned, so proxy, engine and load share it."
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"bench: {machine()}\nbench: {pinning}", flush=True)

    results: list[Measured] = []
    profile = None
    with ExitStack() as stack:
        runner = stack.enter_context(asyncio.Runner(loop_factory=uvloop.new_event_loop))
        engine = targets.Engine(load_cpu, CHUNKS, args.chunk_gap_ms)
        stack.callback(engine.stop)
        engine.start()
        bench = Bench(runner, load_cpu)
        kinds = [targets.Target, *(targets.PEERS[p] for p in args.peers), targets.Router,
                 targets.AiohttpRouter, targets.NoSpoolRouter, targets.LimitedRouter]  # fmt: skip
        if args.every_level:
            kinds.append(targets.EveryLevelRouter)
        if args.front_door_only:
            kinds = [targets.FrontDoorRouter]
        else:
            kinds.append(targets.FrontDoorRouter)
        front = []
        for kind in kinds:
            target = kind(engine, proxy_cpu)
            print(f"bench: {target.label}", flush=True)
            try:
                target.start()
                if isinstance(target, targets.FrontDoorRouter):
                    bench.wait_working(target)
                    front = bench.front_door(target)
                    continue
                m = bench.measure(target)
                if args.profile and isinstance(target, targets.Router):
                    print("  llmgw: profiling with py-spy", flush=True)
                    profile = bench.profile(target)
                target.finish()
                m.version, m.notes = target.version, m.notes + target.notes
            except Skip as e:
                print(f"  {target.name}: skipped: {e}", flush=True)
                m = Measured(target.name, target.label, target.version, skipped=str(e))
                if kind is targets.Target:
                    print("bench: the engine does not answer; giving up", file=sys.stderr)
                    return 1
            finally:
                target.stop()
            results.append(m)

        paired = {}
        measured = {m.name for m in results if not m.skipped}
        for kind in kinds:
            if not issubclass(kind, targets.LimitedRouter) or kind.name not in measured:
                continue
            name = kind.name
            base, other = targets.Router(engine, proxy_cpu), kind(engine, proxy_cpu)
            print(f"bench: {other.label}, side by side with {base.label}", flush=True)
            try:
                base.start()
                other.start()
                paired[name] = bench.side_by_side(base, other)
            except Skip as e:
                print(f"  {name} side by side: skipped: {e}", flush=True)
            finally:
                other.stop()
                base.stop()

        baseline = None
        if args.baseline and "llmgw" in measured:
            base = targets.BaselineRouter(engine, proxy_cpu, args.baseline)
            now = targets.Router(engine, proxy_cpu)
            print(f"bench: {now.label}, side by side with {base.name}", flush=True)
            try:
                base.start()
                now.start()
                baseline = (args.baseline, bench.side_by_side(base, now))
            except Skip as e:
                print(f"  {base.name} side by side: skipped: {e}", flush=True)
            finally:
                now.stop()
                base.stop()

        paced = {}
        if not args.front_door_only and not args.chunk_gap_ms:
            slow = targets.Engine(load_cpu, CHUNKS, PACED_GAP_MS)
            stack.callback(slow.stop)
            slow.start()
            pacers = ([targets.PEERS["nginx"]] if "nginx" in args.peers else []) + [targets.Router]
            for kind in pacers:
                target = kind(slow, proxy_cpu)
                print(f"bench: {target.label}, chunks {PACED_GAP_MS:g} ms apart", flush=True)
                try:
                    target.start()
                    paced[target.name] = bench.paced(target)
                except Skip as e:
                    print(f"  {target.name}: skipped: {e}", flush=True)
                finally:
                    target.stop()

    if args.front_door_only:  # no table, and bench/RESULTS.md is left as it was
        print("\n".join(["", *front]))
        return 0 if front and "failed" not in front[0] else 1
    rows = table_rows(results)
    print()
    print(text_table(rows))
    print()
    for line in notes(results) + bar_check(results, paced, paired, baseline) + front:
        print(line)
    if args.smoke:  # too short to be a result: bench/RESULTS.md is left as it was
        print("\nbench: smoke run; RESULTS.md not written")
        return 0
    results_md = targets.BENCH / "RESULTS.md"
    write_results(results_md, results, rows, pinning, when, args.chunk_gap_ms, front, paced,
                  paired, baseline)  # fmt: skip
    print(f"\nbench: wrote {results_md.relative_to(targets.ROOT)}")
    if profile is not None:
        profile_md = targets.BENCH / "PROFILE.md"
        summary = write_profile(profile_md, profile, when)
        print(f"\nllmgw-router, top functions by own samples:\n{summary}")
        print(f"bench: wrote {profile_md.relative_to(targets.ROOT)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\nbench: interrupted; processes stopped", file=sys.stderr)
        sys.exit(130)
