"""The scheduler's Prometheus metrics, set from its inventory after every pass."""

from prometheus_client import Counter, Gauge

NODES_UP = Gauge("llmgw_nodes_up", "Nodes heard from recently")
NODES_LOST = Gauge("llmgw_nodes_lost", "Nodes that stopped heartbeating")
MEMORY_TOTAL = Gauge("llmgw_node_memory_bytes", "Memory per node", ["node"])
MEMORY_FREE = Gauge("llmgw_node_memory_available_bytes", "Memory available per node", ["node"])
GPUS = Gauge("llmgw_node_gpus", "GPUs per node", ["node"])
REPLICAS = Gauge("llmgw_replicas", "Replicas by model and state", ["model", "state"])
READY = Gauge("llmgw_model_replicas_ready", "Ready replicas per model (0 when none)", ["model"])
DESIRED = Gauge(
    "llmgw_model_replicas_desired",
    "Replicas each model should have now (its min; 1 for an on-demand model in use)",
    ["model"],
)
IDLE = Gauge(
    "llmgw_replica_idle_seconds",
    "Seconds since a ready replica last answered a request (or became ready)",
    ["model", "replica", "node"],
)
INSTALLS = Gauge(
    "llmgw_node_engine_install", "Engine installs per node", ["node", "engine", "state"]
)

PARKED = Gauge(
    "llmgw_model_parked", "1 while a model is parked after repeated failed starts", ["model"]
)
UNPLACEABLE = Gauge(
    "llmgw_model_unplaceable", "1 while a model below min fits on no node", ["model"]
)
START_FAILURES = Gauge(
    "llmgw_model_start_failures",
    "Failed starts in a row (0 after a replica becomes ready)",
    ["model"],
)
BACKUP = Gauge(
    "llmgw_backup_last_success_timestamp_seconds",
    "When the newest backup archive was written (0: never)",
)

LEADER = Gauge(
    "llmgw_control_plane_leader", "1 while this scheduler holds the leader lease", ["scheduler"]
)
EPOCH = Gauge("llmgw_control_plane_epoch", "The newest leader epoch this scheduler took")
RENEW_FAILURES = Counter(
    "llmgw_control_plane_renew_failures_total", "Lease renewals that could not reach the store"
)

_STATES = ("pending", "starting", "ready", "draining", "stopping")


def watch_backups(directory) -> None:
    """Read the backup directory at every scrape: 0 until there is an archive, so an
    alert on its age fires even when there has never been one."""
    from llmgw.backups import newest

    def last() -> float:
        found = newest(directory)
        return found[1] if found else 0.0

    BACKUP.set_function(last)


def standby() -> None:
    """A standby publishes no fleet series: only the leader's count, so an alert never
    fires twice, or on a standby's stale idea of what is parked."""
    for labelled in (MEMORY_TOTAL, MEMORY_FREE, GPUS, REPLICAS, READY, DESIRED, IDLE,
                     INSTALLS, PARKED, UNPLACEABLE, START_FAILURES):  # fmt: skip
        labelled.clear()
    NODES_UP.set(0)
    NODES_LOST.set(0)


def observe(sched) -> None:
    inv = sched.inv
    NODES_UP.set(sum(1 for n in inv.nodes.values() if not n.lost))
    NODES_LOST.set(sum(1 for n in inv.nodes.values() if n.lost))
    INSTALLS.clear()
    for n in inv.nodes.values():
        MEMORY_TOTAL.labels(n.id).set(n.memory_total)
        MEMORY_FREE.labels(n.id).set(n.memory_available)
        GPUS.labels(n.id).set(len(n.gpus))
        for eid, info in n.engines.items():
            INSTALLS.labels(n.id, eid, info.get("state", "")).set(1)
    counts = {(m, s): 0 for m in sched.models for s in _STATES}
    for r in inv.replicas.values():
        if r.state in _STATES:
            counts[(r.model, r.state)] = counts.get((r.model, r.state), 0) + 1
    for (model, state), n in counts.items():
        REPLICAS.labels(model, state).set(n)
    now = sched.clock()
    IDLE.clear()
    for r in inv.replicas.values():
        idle = sched.idle_s(r, now)
        if idle is not None:
            IDLE.labels(r.model, r.id, r.node).set(round(idle, 1))
    for name, m in sched.models.items():
        READY.labels(name).set(counts.get((name, "ready"), 0))
        # What it should have now: an active on-demand model wants one.
        DESIRED.labels(name).set(sched.desired_now(m, now))
        PARKED.labels(name).set(1 if name in sched.parked else 0)
        UNPLACEABLE.labels(name).set(1 if name in sched.unplaceable else 0)
        b = sched.backoff.get(name)
        START_FAILURES.labels(name).set(b.failures if b else 0)
