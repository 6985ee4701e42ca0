"""The scheduler's Prometheus metrics.

The fleet's series (nodes, replicas, models, installs, idle times) are not gauges set
after a pass: `Fleet` reads the scheduler's state at every scrape. A model removed at
runtime is gone from the next scrape (a gauge set per model kept a removed parked
model's `ModelParked` firing until the scheduler restarted), and a series never
vanishes between a clear and a set.
"""

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmgw.placement import gpus_needed
from llmgw.states import LIVE, LOST, ShardState

# Spans the exporter sent, dropped or failed to send (llmgw.tracing): on this page too.
from llmgw.tracing import EXPORT_FAILURES, SPANS_DROPPED, SPANS_EXPORTED  # noqa: F401

BACKUP = Gauge(
    "llmgw_backup_last_success_timestamp_seconds",
    "When the newest backup archive was written (0: never)",
)

LEADER = Gauge(
    "llmgw_control_plane_leader", "1 while this scheduler holds the leader lease", ["scheduler"]
)
EPOCH = Gauge("llmgw_control_plane_epoch", "The newest leader epoch this scheduler took")
ADMIN_UNAUTHENTICATED = Counter(
    "llmgw_admin_unauthenticated_total",
    "Admin API requests refused for a missing or wrong token (not in the audit log)",
    ["access"],
)
RENEW_FAILURES = Counter(
    "llmgw_control_plane_renew_failures_total", "Lease renewals that could not reach the store"
)

# Replication between schedulers (replicator.py): each scheduler's own copy of the
# mirror's blobs and the published releases.
REPLICATION_MISSING = Gauge(
    "llmgw_mirror_replication_missing_blobs",
    "Mirror blobs and release files the store names that this scheduler does not hold",
    ["scheduler"],
)
REPLICATION_MISSING_BYTES = Gauge(
    "llmgw_mirror_replication_missing_bytes",
    "Bytes of the blobs and release files this scheduler does not hold",
    ["scheduler"],
)
REPLICATION_COPIED = Counter(
    "llmgw_mirror_replication_copied_total",
    "Blobs and release files copied from a peer scheduler, checked and kept",
    ["scheduler"],
)
REPLICATION_COPIED_BYTES = Counter(
    "llmgw_mirror_replication_copied_bytes_total",
    "Bytes received from peer schedulers (a resumed transfer counts only what it received)",
    ["scheduler"],
)
REPLICATION_FAILURES = Counter(
    "llmgw_mirror_replication_failures_total",
    "Failed copies from a peer, by reason: corrupt (sha256 mismatch: discarded), cut"
    " (ended early: resumed next time), absent (the peer lacks it too), peer_error,"
    " no_peer (no other scheduler to ask), invalid (a name that cannot be a file)",
    ["scheduler", "reason"],
)
REPLICATION_BACKOFF = Gauge(
    "llmgw_mirror_replication_backoff_seconds",
    "The longest wait between tries of a copy that keeps failing (0: none failing);"
    " at scheduler.replicate_backoff_max_s it has backed off as far as it goes",
    ["scheduler"],
)


def watch_backups(directory) -> None:
    """Read the backup directory at every scrape: 0 until there is an archive, so an
    alert on its age fires even when there has never been one."""
    from llmgw.backups import newest

    def last() -> float:
        found = newest(directory)
        return found[1] if found else 0.0

    BACKUP.set_function(last)


# Replica states published per model, every one (0 included) for every model.
STATES = (*LIVE, ShardState.STOPPING, LOST)


class Fleet:
    """A prometheus_client collector of the fleet's series, read at scrape time under the
    scheduler's lock. A standby, or a leader before its first pass (still settling: its
    inventory is not whole yet), publishes none of them: only the leader's count, so an
    alert never fires twice or on a standby's stale idea of what is parked."""

    def __init__(self, sched):
        self.sched = sched

    def describe(self):
        return []  # names are not fixed per scrape: collect only when scraped

    def collect(self):
        s = self.sched
        with s.lock:
            now = s.clock()
            if not s.leading() or s.last_pass_at is None:
                return
            yield from self._families(s, now)

    @staticmethod
    def _families(s, now: float):
        inv = s.inv
        lost = inv.lost_nodes()
        nodes_up = GaugeMetricFamily("llmgw_nodes_up", "Nodes heard from recently")
        nodes_up.add_metric([], sum(1 for n in inv.nodes.values() if not n.lost))
        nodes_lost = GaugeMetricFamily("llmgw_nodes_lost", "Nodes that stopped heartbeating")
        nodes_lost.add_metric([], len(lost))
        memory = GaugeMetricFamily("llmgw_node_memory_bytes", "Memory per node", labels=["node"])
        available = GaugeMetricFamily(
            "llmgw_node_memory_available_bytes",
            "Memory available per node (none for a lost node: not known)",
            labels=["node"],
        )
        gpus = GaugeMetricFamily("llmgw_node_gpus", "GPUs per node", labels=["node"])
        installs = GaugeMetricFamily(
            "llmgw_node_engine_install", "Engine installs per node",
            labels=["node", "engine", "state"],
        )  # fmt: skip
        gpus_free = GaugeMetricFamily(
            "llmgw_node_gpus_free",
            "GPUs a new replica could be given: healthy, whole (not in MIG mode) and assigned"
            " to no replica; 0 on a draining node, none for a lost one",
            labels=["node"],
        )
        for v in sorted(s.node_views(), key=lambda v: v.id):
            if not v.lost:
                free = 0 if v.draining else sum(1 for g in v.gpus if not g.why_not)
                gpus_free.add_metric([v.id], free)
        for n in sorted(inv.nodes.values(), key=lambda n: n.id):
            memory.add_metric([n.id], n.memory_total)
            gpus.add_metric([n.id], len(n.gpus))
            if not n.lost:
                available.add_metric([n.id], n.memory_available)
            for eid, info in sorted(n.engines.items()):
                installs.add_metric([n.id, eid, info.get("state", "")], 1)

        counts = {(m, st): 0 for m in s.models for st in STATES}
        idle = GaugeMetricFamily(
            "llmgw_replica_idle_seconds",
            "Seconds since a ready replica last answered a request (or became ready)",
            labels=["model", "replica", "node"],
        )
        for r in inv.replicas.values():
            state = inv.state_of(r, lost)
            if state in STATES and r.model in s.models:
                counts[(r.model, state)] += 1
            seconds = s.idle_s(r, now) if state != LOST else None
            if seconds is not None:
                idle.add_metric([r.model, r.id, r.node], round(seconds, 1))
        replicas = GaugeMetricFamily(
            "llmgw_replicas",
            "Replicas by model and state (lost: on a lost node, counting toward nothing)",
            labels=["model", "state"],
        )
        for (model, state), n in counts.items():
            replicas.add_metric([model, state], n)

        ready = GaugeMetricFamily(
            "llmgw_model_replicas_ready",
            "Ready replicas per model on live nodes (0 when none)",
            labels=["model"],
        )
        desired = GaugeMetricFamily(
            "llmgw_model_replicas_desired",
            "Replicas each model should have now (the autoscaler's count between min and max;"
            " 1 for an on-demand model in use)",
            labels=["model"],
        )
        parked = GaugeMetricFamily(
            "llmgw_model_parked", "1 while a model is parked after repeated failed starts",
            labels=["model"],
        )  # fmt: skip
        unplaceable = GaugeMetricFamily(
            "llmgw_model_unplaceable", "1 while a model below min fits on no node",
            labels=["model"],
        )  # fmt: skip
        blocked = GaugeMetricFamily(
            "llmgw_model_scale_blocked",
            "1 while a model wants another replica (scaled up) and it fits on no node",
            labels=["model"],
        )
        decisions = CounterMetricFamily(
            "llmgw_model_scale_decisions",
            "Autoscaling decisions since the scheduler started, by direction (up, down)",
            labels=["direction"],
        )
        for direction, n in s.autoscaler.decisions.items():
            decisions.add_metric([direction], n)
        evictions = CounterMetricFamily(
            "llmgw_model_evictions",
            "Times the model was evicted to make room for another on-demand model",
            labels=["model"],
        )
        cold_start = GaugeMetricFamily(
            "llmgw_model_cold_start_seconds",
            "Seconds from the decision to start a replica until it was ready, as measured"
            " (a moving average); eviction weighs it",
            labels=["model"],
        )
        gpus_need = GaugeMetricFamily(
            "llmgw_model_gpus_needed", "GPUs each replica of the model takes (0: none)",
            labels=["model"],
        )  # fmt: skip
        failures = GaugeMetricFamily(
            "llmgw_model_start_failures",
            "Failed starts in a row (0 after a replica becomes ready)",
            labels=["model"],
        )
        for name, m in s.models.items():
            ready.add_metric([name], counts[(name, ShardState.READY)])
            desired.add_metric([name], s.desired_now(m, now))
            parked.add_metric([name], 1 if name in s.parked else 0)
            unplaceable.add_metric([name], 1 if name in s.unplaceable else 0)
            blocked.add_metric([name], 1 if name in s.autoscaler.blocked else 0)
            gpus_need.add_metric([name], gpus_needed(s.needs.need(m)))
            b = s.backoff.get(name)
            failures.add_metric([name], b.failures if b else 0)
            if m.min == 0:
                evictions.add_metric([name], s.eviction.evictions.get(name, 0))
            if name in s.coldstarts.seconds:
                cold_start.add_metric([name], round(s.coldstarts.seconds[name], 1))
        yield from (nodes_up, nodes_lost, memory, available, gpus, gpus_free, installs,
                    replicas, ready, desired, parked, unplaceable, blocked, gpus_need,
                    decisions, evictions, cold_start, failures, idle)  # fmt: skip


def watch_fleet(sched, registry=REGISTRY) -> Fleet:
    """Publish `sched`'s fleet series from `registry` (the default one, for /metrics)."""
    collector = Fleet(sched)
    registry.register(collector)
    return collector
