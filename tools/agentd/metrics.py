"""llmgw-agentd's Prometheus metrics, set from the agent's state at every heartbeat."""

from prometheus_client import Counter, Gauge

from llmgw_agentd import engines, supervisor

SHARDS = Gauge("llmgw_agent_shards", "Shards on this node by state", ["state"])
INSTALLS = Gauge(
    "llmgw_agent_engine_installs",
    "Engines by install state (1 = in that state)",
    ["engine", "state"],
)
MEMORY_AVAILABLE = Gauge("llmgw_agent_memory_available_bytes", "Memory available for shards")
MEMORY_TOTAL = Gauge(
    "llmgw_agent_memory_total_bytes", "Memory on this node (or agent.memory_bytes)"
)

REFUSED = Counter(
    "llmgw_agent_commands_refused_total",
    "Commands refused, by why (stale_epoch: from a scheduler that no longer leads)",
    ["reason"],
)
EPOCH = Gauge("llmgw_agent_leader_epoch", "The newest leader epoch this agent has seen")


def update(body: dict) -> None:
    """Set every gauge from a hello/heartbeat body."""
    counts = dict.fromkeys(supervisor.STATES, 0)
    for shard in body["shards"]:
        counts[shard["state"]] = counts.get(shard["state"], 0) + 1
    for state, n in counts.items():
        SHARDS.labels(state).set(n)
    for engine_id, install in body["engines"].items():
        for state in engines.STATES:
            INSTALLS.labels(engine_id, state).set(1 if install["state"] == state else 0)
    MEMORY_AVAILABLE.set(body["resources"]["memory_available"])
    MEMORY_TOTAL.set(body["resources"]["memory_total"])
