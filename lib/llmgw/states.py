"""One vocabulary for what the scheduler, agents and routers say to each other.

`StrEnum` members equal their strings ("ready" == ShardState.READY), so the wire format in
docs/bus.md is these values, and a body decoded from JSON compares with them as is.
"""

from enum import StrEnum


class ShardState(StrEnum):
    """A replica's state: what an agent reports of a shard, plus `pending` (asked for by
    the scheduler, not reported yet) and `stopping` (asked to stop, not gone yet)."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    FAILED = "failed"
    STOPPED = "stopped"


# Running, or on its way: what counts toward a model's replicas and a node's memory.
LIVE = (ShardState.PENDING, ShardState.STARTING, ShardState.READY, ShardState.DRAINING)
# Placed or serving, for the reconciler's counts (a draining one is on its way out).
ACTIVE = (ShardState.PENDING, ShardState.STARTING, ShardState.READY)
# Not started yet by its engine: a timeout or a vanishing is a failed start.
STARTING = (ShardState.PENDING, ShardState.STARTING)
# On its way out or gone.
GONE = (ShardState.STOPPING, ShardState.FAILED, ShardState.STOPPED)
# Reported by an agent but no longer there: the inventory forgets it.
ENDED = (ShardState.FAILED, ShardState.STOPPED)
# Not a state an agent reports: a live replica on a lost node, as operators see it.
LOST = "lost"


class ModelState(StrEnum):
    """A model's state, as the routing table and `llmgw models` say it."""

    SERVING = "serving"  # a ready replica on a live node
    STARTING = "starting"
    BACKOFF = "backoff"  # its last start failed: the next waits
    PARKED = "parked"  # failed too often: waits for `llmgw retry`
    UNPLACEABLE = "unplaceable"  # fits on no node
    STOPPED = "stopped"  # on demand, and idle


class MsgType(StrEnum):
    """A bus message's `type` (docs/bus.md)."""

    # agent -> scheduler
    HELLO = "hello"
    HEARTBEAT = "heartbeat"
    SHARD_STATUS = "shard_status"
    REFUSED = "refused"
    LOGS = "logs"
    INSTALL_STATUS = "install_status"
    FABRIC_READY = "fabric_ready"
    FABRIC_RESULT = "fabric_result"
    # router -> scheduler
    WANT = "want"
    ACTIVITY = "activity"
    # scheduler -> agent
    LEADER = "leader"
    START_SHARD = "start_shard"
    STOP_SHARD = "stop_shard"
    INSTALL_ENGINE = "install_engine"
    GET_LOGS = "get_logs"
    FABRIC_LISTEN = "fabric_listen"
    FABRIC_TEST = "fabric_test"
    SET_ADAPTERS = "set_adapters"
    # scheduler -> routers (PUB)
    ROUTES = "routes"
    ROUTES_DIFF = "routes_diff"


# What an agent says about itself: every one carries the node's whole state.
REPORTS = (MsgType.HELLO, MsgType.HEARTBEAT)
