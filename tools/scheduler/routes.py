"""The admin API as one table: every route's method, path, who may call it, whether it
needs the leader, the audit actions it writes, and its handler.

`admin.Handler` is the one dispatcher: it matches a request here, authenticates it as
the route's access says, refuses a change on a standby, parses the JSON body and maps
the handler's refusals to statuses. No handler sees a request before that: safety that
rested on each sub-API ignoring the paths that were not its own broke with the next one.

A handler is `handler(h, **params)`, the params being the path's `{names}`; it returns
(status, JSON body), or None once it has answered itself (a stream, a file, the page).
"""

from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

from llmgw.errors import NotFound
from llmgw_scheduler import (
    credentials_api,
    fabric_api,
    fleet_api,
    join_api,
    mirror_api,
    onboarding_api,
    page,
    registry,
    releases_api,
    signon,
    tenancy_api,
    usage_check,
)
from llmgw_scheduler.errors import MethodNotAllowed


class Access(StrEnum):
    """Who may call a route."""

    PUBLIC = "public"  # anyone: the cluster CA's certificate, public anyway
    NODE = "node"  # a registered node: X-Llmgw-Node and HMAC(cluster secret, name)
    PEER = "peer"  # another scheduler: X-Llmgw-Scheduler and its HMAC (mirror.peer_token)
    JOIN = "join"  # a node joining: the one-time join token in the body, over HTTPS
    PAGE = "page"  # any operator from a browser: a bearer token, the cookie or ?token=
    # anyone on the way into or out of a sign-on session (signon.py): the identity
    # provider vouches for them at the callback, which checks what it sends back
    SIGNON = "signon"
    READ = "read"  # any operator's bearer token (read or admin)
    ADMIN = "admin"  # an admin operator's bearer token


# Who is not an operator: the routes that operators' tokens do not open.
NOT_OPERATORS = (Access.PUBLIC, Access.NODE, Access.PEER, Access.JOIN)


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # segments, each a literal or a {name} that the handler gets as an argument
    access: Access
    handler: object
    leader: bool = False  # a change: a standby answers 409 not_leader, naming the leader
    audit: tuple[str, ...] = ()  # the audit actions it may write; the first by default
    body: bool = False  # a JSON object, parsed (400 if not) before the handler runs
    segments: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(self.path.strip("/").split("/")))

    def params(self, parts: list[str]) -> dict[str, str] | None:
        """The path's named segments if `parts` is this route's path, else None."""
        if len(parts) != len(self.segments):
            return None
        out = {}
        for want, got in zip(self.segments, parts, strict=True):
            if want.startswith("{"):
                out[want[1:-1]] = got
            elif want != got:
                return None
        return out

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


def match(routes, method: str, path: str, parts: list[str]) -> tuple[Route, dict[str, str]]:
    """The route for `method` and the path's `parts`, with its params: NotFound for a
    path no route has, MethodNotAllowed for one asked with another method."""
    allow = []
    for route in routes:
        params = route.params(parts)
        if params is None:
            continue
        if route.method == method:
            return route, params
        allow.append(route.method)
    if allow:
        raise MethodNotAllowed(f"{path} takes {', '.join(sorted(set(allow)))}, not {method}",
                               sorted(set(allow)))  # fmt: skip
    raise NotFound(f"no such endpoint: {method} {path}")


def read(path: str, handler) -> Route:
    """A GET for any operator, answered on a standby too."""
    return Route("GET", path, Access.READ, handler)


def change(method: str, path: str, handler, *audit: str, body: bool = True) -> Route:
    """A change for an admin, on the leader only."""
    return Route(method, path, Access.ADMIN, handler, leader=True, audit=audit, body=body)


def _tenancy() -> list[Route]:
    """Orgs, teams, projects and users: one set of routes per collection."""
    out = []
    for coll, kind in tenancy_api.COLLECTIONS.items():
        remove = partial(tenancy_api.remove, coll)
        out += [
            read(f"/v1/{coll}", partial(tenancy_api.listing, kind)),
            read(f"/v1/{coll}/{{name}}", partial(tenancy_api.show, kind)),
            change("POST", f"/v1/{coll}", partial(tenancy_api.create, coll), f"{coll}.create"),
            change("POST", f"/v1/{coll}/{{name}}/remove", remove, f"{coll}.remove"),
        ]
    return out


ROUTES: tuple[Route, ...] = (
    # For browsers: the status page, with its own ways to authenticate (page.py).
    Route("GET", "/", Access.PAGE, page.serve),
    Route("GET", "/status", Access.PAGE, page.serve),
    # Sign-on through the identity provider (signon.py): on the way to a credential.
    Route("GET", "/login", Access.SIGNON, signon.login),
    Route("GET", "/oidc/callback", Access.SIGNON, signon.callback),
    Route("POST", "/logout", Access.SIGNON, signon.logout),
    Route("GET", "/v1/signon", Access.SIGNON, signon.settings),
    # For nodes, with their own credentials or none; never an operator's token.
    Route("GET", "/v1/join/ca", Access.PUBLIC, join_api.ca),
    Route("POST", "/v1/join", Access.JOIN, join_api.join, body=True,
          audit=("nodes.join", "nodes.join_refused")),
    Route("GET", "/v1/mirror/blobs/{sha256}", Access.NODE, mirror_api.blob),
    # For the other schedulers, copying what they lack (replicator.py), on a standby too.
    Route("GET", "/v1/replication/blobs/{sha256}", Access.PEER, mirror_api.peer_blob),
    Route("GET", "/v1/replication/releases/{filename}", Access.PEER, releases_api.peer_file),
    # Reads: any operator, on a standby too.
    read("/v1/status", fleet_api.status),
    read("/v1/nodes", fleet_api.nodes),
    read("/v1/models", fleet_api.models),
    read("/v1/replicas", fleet_api.replicas),
    read("/v1/restarts", fleet_api.restarts),
    read("/v1/models/{name}/placement", fleet_api.placement),
    read("/v1/nodes/{node}/shards/{shard}/logs", fleet_api.logs),
    read("/v1/nodes/{name}/access", onboarding_api.show),
    read("/v1/operators", credentials_api.operators_list),
    read("/v1/whoami", credentials_api.whoami),
    read("/v1/keys", registry.keys_list),
    read("/v1/peers", registry.peers_list),
    read("/v1/audit", registry.audit_list),
    read("/v1/releases", releases_api.listing),
    read("/v1/releases/{filename}", releases_api.download),
    read("/v1/weights", mirror_api.weights_list),
    read("/v1/limits", tenancy_api.limits),
    read("/v1/budgets", tenancy_api.budgets),
    read("/v1/usage", tenancy_api.usage_report),
    read("/v1/usage/reconcile", usage_check.usage_reconcile),
    # This scheduler's own secrets: an admin, on a standby too (each has its own).
    Route("POST", "/v1/admin-token/rotate", Access.ADMIN, credentials_api.rotate_token,
          audit=("admin_token.rotate",)),
    Route("POST", "/v1/scheduler-key/rotate", Access.ADMIN, credentials_api.rotate_key,
          body=True, audit=("scheduler_key.begin", "scheduler_key.finish")),
    # Changes: an admin, on the leader.
    change("POST", "/v1/operators", credentials_api.operators_add, "operators.add"),
    change("DELETE", "/v1/operators/{name}", credentials_api.operators_remove,
           "operators.remove", body=False),
    change("POST", "/v1/models", fleet_api.add_model, "models.add"),
    change("DELETE", "/v1/models/{name}", fleet_api.remove_model, "models.remove", body=False),
    change("POST", "/v1/models/{name}/scale", fleet_api.scale, "models.scale"),
    change("POST", "/v1/models/{name}/retry", fleet_api.retry, "models.retry", body=False),
    change("POST", "/v1/restarts", fleet_api.restart, "restart"),
    change("POST", "/v1/nodes/{name}/drain", fleet_api.drain, "nodes.drain", body=False),
    change("POST", "/v1/nodes/{name}/undrain", fleet_api.undrain, "nodes.undrain", body=False),
    change("POST", "/v1/nodes/{name}/join-token", join_api.join_token, "nodes.join_token"),
    change("POST", "/v1/nodes/{name}/access", onboarding_api.record, "nodes.access"),
    change("POST", "/v1/fabric/test", fabric_api.measure),
    change("POST", "/v1/keys", registry.keys_create, "keys.create"),
    change("POST", "/v1/keys/revoke", registry.keys_revoke, "keys.revoke"),
    change("POST", "/v1/peers", registry.peers_add, "nodes.add", "routers.add"),
    change("DELETE", "/v1/peers/{name}", registry.peers_remove, "nodes.remove",
           "routers.remove", body=False),
    # The wheel's bytes are the body, not JSON.
    change("POST", "/v1/releases/{filename}", releases_api.publish, "release.publish",
           body=False),
    change("POST", "/v1/weights/pull", mirror_api.weights_pull, "weights.pull"),
    change("POST", "/v1/weights/verify", mirror_api.weights_verify, "weights.verify"),
    change("DELETE", "/v1/weights/{model}", mirror_api.weights_remove, "weights.rm",
           body=False),
    *_tenancy(),
    change("POST", "/v1/projects/{name}/band", tenancy_api.band, "projects.band"),
    change("POST", "/v1/limits", tenancy_api.limits_set, "limits.set"),
    change("POST", "/v1/limits/remove", tenancy_api.limits_remove, "limits.remove"),
    change("POST", "/v1/budgets", tenancy_api.budgets_set, "budgets.set"),
    change("POST", "/v1/budgets/remove", tenancy_api.budgets_remove, "budgets.remove"),
    change("POST", "/v1/usage/rollup", tenancy_api.rollup, "usage.rollup"),
)  # fmt: skip
