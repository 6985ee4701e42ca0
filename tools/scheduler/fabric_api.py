"""`POST /v1/fabric/test`: latency and bandwidth between nodes over their fabric.

For each pair of nodes (a, b), b is told to open its test endpoint on its fabric
address with a one-time token (`fabric_listen`), then a to measure to it
(`fabric_test`); both answer over the bus to a waiter keyed by request id (the one
`llmgw logs` uses). Pairs run one after another so that no two tests share a link and
halve each other's bandwidth. The handler thread waits without the scheduler's lock.
"""

import itertools
import secrets
import threading

from llmgw.errors import Invalid
from llmgw.states import MsgType

READY_WAIT_S = 5.0
RESULT_WAIT_S = 60.0
DEFAULT_BYTES = 64 << 20
MAX_BYTES = 4 << 30


def _ask(s, node: str, kind: str, body: dict) -> dict:
    """Queue a command whose answer carries our request id; call under the lock."""
    request = secrets.token_hex(8)
    entry = {"done": threading.Event(), "reply": None, "request": request}
    s.log_requests[request] = entry
    s.outbox.send(node, kind, {**body, "request": request})
    return entry


def _wait(s, entry: dict, seconds: float) -> dict | None:
    try:
        return entry["reply"] if entry["done"].wait(seconds) else None
    finally:
        with s.lock:
            s.log_requests.pop(entry["request"], None)


def _fabric(s, node: str) -> dict:
    return (s.inv.nodes[node].topology or {}).get("fabric") or {}


def pair(s, a: str, b: str, size: int) -> dict:
    """One measurement, a to b, as a row: {from, to, address, latency_ms, …, error}."""
    row = {"from": a, "to": b, "address": _fabric(s, b).get("address", ""), "error": ""}
    token = secrets.token_hex(16)
    with s.lock:
        s.connected(b)
        entry = _ask(s, b, MsgType.FABRIC_LISTEN, {"token": token, "seconds": RESULT_WAIT_S})
    ready = _wait(s, entry, READY_WAIT_S)
    if ready is None:
        return {**row, "error": f"node '{b}' did not open its endpoint within {READY_WAIT_S:g}s"}
    if ready.get("error"):
        return {**row, "error": f"{b}: {ready['error']}"}
    row["address"] = f"{ready['address']}:{ready['port']}"
    with s.lock:
        s.connected(a)
        entry = _ask(s, a, MsgType.FABRIC_TEST, {
            "target": b, "address": ready["address"], "port": ready["port"],
            "token": token, "bytes": size,
        })  # fmt: skip
    result = _wait(s, entry, RESULT_WAIT_S)
    if result is None:
        return {**row, "error": f"node '{a}' did not answer within {RESULT_WAIT_S:g}s"}
    if result.get("error"):
        return {**row, "error": f"{a}: {result['error']}"}
    keep = ("latency_ms", "latency_min_ms", "pings", "bytes", "seconds", "bits_per_second")
    return {**row, **{k: result.get(k) for k in keep}}


def run(s, nodes: list[str], size: int) -> dict:
    """Every pair of `nodes`, in the order given; with none, every pair of connected
    nodes that report a fabric address and share an `agent.fabric` label (nodes on
    different fabrics are not expected to reach each other there)."""
    with s.lock:
        asked = list(dict.fromkeys(nodes))
        if not asked:
            asked = sorted(n.id for n in s.inv.nodes.values()
                           if not n.lost and _fabric(s, n.id).get("address"))  # fmt: skip
        for n in asked:
            s.connected(n)
        label = {n: _fabric(s, n).get("label", "") for n in asked}
    pairs = [(a, b) for a, b in itertools.combinations(asked, 2)
             if nodes or label[a] == label[b]]  # fmt: skip
    if not pairs:
        raise Invalid(
            "a fabric test needs two connected nodes"
            + ("" if nodes else " that report agent.fabric_address on the same agent.fabric")
        )
    return {"nodes": asked, "results": [pair(s, a, b, size) for a, b in pairs]}


def measure(h):
    """POST /v1/fabric/test: {"nodes": [...], "bytes": N}; not a change, so not audited."""
    nodes = h.body.get("nodes") or []
    size = h.body.get("bytes", DEFAULT_BYTES)
    if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
        raise Invalid("nodes must be a list of node names")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BYTES:
        raise Invalid(f"bytes must be a whole number from 1 to {MAX_BYTES}")
    return 200, run(h.sched, nodes, size)
