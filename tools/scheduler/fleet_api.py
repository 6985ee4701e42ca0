"""The admin API's view of the fleet: nodes, models, replicas and restarts as JSON, and
the changes to them (models, scale, retry, restarts, drains).

Reads take a consistent snapshot under the scheduler's lock; changes are applied under
the same lock and answered 202 when they take effect on the next pass (a queued change
is not an error). Each handler is a route's in routes.py.
"""

from llmgw import lease
from llmgw.errors import Invalid, NotFound
from llmgw.placement import Fleet, first_fit, gpus_needed, pick_gpus
from llmgw.states import LIVE, LOST, ShardState
from llmgw.store import SchedulerSeen
from llmgw_scheduler.errors import AgentSilent
from llmgw_scheduler.models import profile_of

# How long `llmgw logs` waits for the agent to answer.
LOGS_WAIT_S = 5.0


class View:
    """The API's JSON shapes, built from the scheduler's state (call under its lock)."""

    def __init__(self, sched):
        self.s = sched

    def node(self, n) -> dict:
        # A lost node's last report is no longer the truth: none of its memory or GPUs is
        # in use by anything that counts, and its replicas are lost (None: not known).
        return {
            "name": n.id, "state": "lost" if n.lost else "draining" if n.draining else "up",
            "cpus": n.cpus,
            "memory_total": n.memory_total,
            "memory_available": None if n.lost else n.memory_available,
            "gpus": [] if n.lost else self.gpus(n), "engines": n.engines,
            "replicas": len(self.s.inv.on_node(n.id)),
            "last_seen": n.last_seen, "version": n.version or None,
            "disk_total": n.disk_total or None, "disk_free": n.disk_free or None,
            "fetching": [] if n.lost else n.fetching,
            "topology": n.topology,
        }  # fmt: skip

    def gpus(self, n) -> list[dict]:
        """The node's GPUs as its agent reports them, each with the replica assigned it
        and that replica's model (None: nothing holds it)."""
        holder = {uuid: r for r in self.s.inv.on_node(n.id) for uuid in r.gpus}
        out = []
        for g in n.gpus:
            if not isinstance(g, dict):
                continue
            r = holder.get(str(g.get("uuid") or g.get("index", "")))
            out.append({**g, "replica": r.id if r else None, "model": r.model if r else None})
        return out

    def nodes(self) -> list[dict]:
        out = [self.node(n) for n in sorted(self.s.inv.nodes.values(), key=lambda n: n.id)]
        seen = {n["name"] for n in out}
        for peer in self.s.registered_nodes:
            if peer not in seen:
                out.append({"name": peer, "state": "never seen", "cpus": 0, "memory_total": 0,
                            "memory_available": 0, "gpus": [], "engines": {}, "replicas": 0,
                            "last_seen": None, "version": None, "disk_total": None,
                            "disk_free": None, "fetching": [], "topology": {}})  # fmt: skip
        return out

    def model(self, m) -> dict:
        s = self.s
        state, reason = s.model_status(m.name)
        lost = s.inv.lost_nodes()
        mine = [s.inv.state_of(r, lost) for r in s.inv.of_model(m.name)]
        b = s.backoff.get(m.name)
        # Replicas on lost nodes count toward nothing: not ready, not among its replicas.
        return {
            "name": m.name, "aliases": list(m.aliases), "engine": m.engine_id,
            "min": m.min, "max": m.max, "desired": s.desired_now(m, s.clock()),
            "desired_reason": s.desired_why(m.name),
            "ready": mine.count(ShardState.READY), "replicas": len(mine) - mine.count(LOST),
            "lost": mine.count(LOST),
            "state": state, "reason": reason,
            "failures": b.failures if b else 0,
            "retry_at": b.next_at if b and b.failures and state == "backoff" else None,
            "memory": s.needs.need(m).memory,
        }  # fmt: skip

    def adapter(self, a) -> dict:
        """An adapter as a MODEL: its base's engine, no replicas of its own, and the
        replicas of its base that serve it (`loaded_on`)."""
        s = self.s
        state, reason = s.views.status_of(a.name)
        on = [{"replica": r.id, "node": r.node} for r in s.adapters.loaded_on(a.name)]
        return {
            "name": a.name, "aliases": list(a.aliases), "engine": a.engine_id,
            "adapter_of": a.adapter_of, "loaded_on": on,
            "min": 0, "max": 0, "desired": 0, "desired_reason": "",
            "ready": len(on), "replicas": len(on), "lost": 0,
            "state": state, "reason": reason, "failures": 0, "retry_at": None, "memory": 0,
        }  # fmt: skip

    def models(self) -> list[dict]:
        return [*(self.model(m) for m in self.s.models.values()),
                *(self.adapter(a) for a in self.s.catalog.adapters.values())]  # fmt: skip

    def replicas(self, model: str | None = None) -> list[dict]:
        now = self.s.clock()
        lost = self.s.inv.lost_nodes()
        return [
            {"id": r.id, "model": r.model, "node": r.node, "state": self.s.inv.state_of(r, lost),
             "endpoint": r.endpoint, "since": r.since, "created": r.created, "rss": r.rss,
             "reason": r.reason, "profile": self.profile(r),
             "restart": self.s.restart_state(r.id), "stale": self.stale(r),
             "idle_s": _round(self.s.idle_s(r, now)),
             **({"adapters": self.s.adapters.serving(r)} if r.adapters else {}),
             **({"gpus": list(r.gpus)} if r.gpus else {}),
             **({"shards": shards} if (shards := self.s.gangs.shards(r.id)) else {})}
            for r in sorted(self.s.inv.replicas.values() if model is None
                            else self.s.inv.of_model(model), key=lambda r: (r.model, r.since))
        ]  # fmt: skip

    def profile(self, r) -> str | None:
        """The name of the profile it runs (None: not known, its model or profile gone)."""
        m = self.s.models.get(r.model)
        return (profile_of(m, r) or None) if m is not None else (r.profile_name or None)

    def stale(self, r) -> bool:
        """Started with a profile (engine, source, args...) that has been edited since."""
        m = self.s.models.get(r.model)
        if m is None or not r.profile:
            return False
        name = profile_of(m, r)
        now = m.at(name) if name else None  # its profile as the catalog has it now
        return now is None or r.profile != now.profile_hash()

    @staticmethod
    def restart(job) -> dict:
        return {
            "replica": job.replica, "model": job.model, "node": job.node,
            "state": job.state, "how": job.how or None,
            "replacement": job.replacement or None, "queued_at": job.queued_at,
            "since": job.since or None, "reason": job.reason,
            "max_surge": job.max_surge, "max_unavailable": job.max_unavailable,
            "in_place": job.in_place,
        }  # fmt: skip

    def restarts(self) -> list[dict]:
        return [self.restart(j) for j in self.s.restarts]

    def placement(self, m) -> dict:
        views = {v.id: v for v in self.s.node_views()}
        # Its profiles in order: the first that fits, else every profile's reasons.
        need, p = first_fit(Fleet(list(views.values())), self.s.needs.options(m), explain=True)
        k = gpus_needed(need)

        def gpus(n: str) -> dict:
            # Which GPUs a replica would be assigned there and why (for a tensor-parallel
            # group, the link joining them), and why each GPU that cannot be taken not.
            v = views[n]
            if not k or not v.gpus:
                return {"gpu_link": "", "gpus": []}
            pick = pick_gpus(v.gpus, k, need.memory, v.topology)
            return {
                "gpu_link": pick.why if pick else "",
                "gpus": [{"index": g.index, "uuid": g.uuid, "free": g.free,
                          "assigned": bool(pick and g.uuid in pick.uuids),
                          "why_not": g.why_not} for g in v.gpus],
            }  # fmt: skip

        return {
            "model": m.name, "profile": need.profile or m.profile_name,
            "profiles": [o.profile_name for o in m.options()],
            "need": {"memory": need.memory, "gpus": need.gpus, "engine": need.engine},
            "choice": p.node, "install": p.install,
            "nodes": [{"name": n, "fits": n not in p.reasons, "reason": p.reasons.get(n, ""),
                       **gpus(n)} for n in sorted(views)],
        }  # fmt: skip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


# -- reads ---------------------------------------------------------------------------


def status(h):
    s = h.sched
    with s.lock:
        view = View(s)
        body = {
            "nodes": view.nodes(),
            "models": view.models(),
            "replicas": view.replicas(),
            "restarts": [j for j in view.restarts() if j["state"] != "done"],
            "control_plane": {"name": s.name, "epoch": s.epoch,
                              "role": "leader" if s.leading() else "standby"},
        }  # fmt: skip
    body["control_plane"].update(control_plane(s))
    return 200, body


def control_plane(s) -> dict:
    """The lease, whether its holder is still heard from, and every scheduler, from the
    store (outside the scheduler's lock): a standby answering for a leader that died must
    not show its lease counting down as if all were well."""
    if s.leadership is None:
        return {}
    ld = s.leadership
    try:
        held = lease.current(ld.db)
        peers = lease.schedulers(ld.db)
        behind = {r.name: (r.missing_blobs, r.missing_bytes) for r in SchedulerSeen.select()}
        if held is None or not held.holder:
            seen = None
        elif held.holder == ld.holder:
            seen = 0.0  # this process: alive, whatever its row says yet
        else:
            seen = lease.holder_seen_s(ld.db, held.holder)
    except Exception as e:
        return {"store_error": str(e)[:200]}
    for p in peers:  # how far its copy of the mirror and releases is behind (None: unsaid)
        p["missing_blobs"], p["missing_bytes"] = behind.get(p["name"], (None, None))
    return {**lease.standing(held, seen, peers, ld.s.renew_s, ld.s.standby_retry_s),
            "schedulers": peers}  # fmt: skip


def _read(h, what):
    with h.sched.lock:
        return 200, what(View(h.sched))


def nodes(h):
    return _read(h, View.nodes)


def models(h):
    return _read(h, View.models)


def restarts(h):
    return _read(h, View.restarts)


def replicas(h):
    return _read(h, lambda view: view.replicas(h.q.get("model")))


def placement(h, name: str):
    return _read(h, lambda view: view.placement(h.sched.model(name)))


def logs(h, node: str, shard: str):
    """Ask the node's agent for a shard's output and wait a few seconds for it, without
    the scheduler's lock."""
    s = h.sched
    with s.lock:
        s.connected(node)
        try:
            lines = int(h.q.get("lines", "100"))
        except ValueError:
            raise Invalid("lines must be a number") from None
        entry = s.ask_logs(node, shard, lines)
    try:
        answered = entry["done"].wait(LOGS_WAIT_S)
    finally:
        with s.lock:
            s.log_requests.pop(entry["request"], None)
    if not answered:
        raise AgentSilent(f"node '{node}' did not answer within {LOGS_WAIT_S:g}s")
    reply = entry["reply"]
    if reply.get("error"):
        raise NotFound(reply["error"], "shard_not_found")
    return 200, {"node": node, "id": shard, "lines": reply.get("lines", [])}


# -- changes -------------------------------------------------------------------------


def add_model(h):
    s = h.sched
    with s.lock:
        m = s.add_model(h.body, s.clock())
        model = View(s).model(m)
    h.audit(m.name)
    return 201, model


def remove_model(h, name: str):
    with h.sched.lock:
        h.sched.remove_model(name)
    h.audit(name)
    return 202, {"model": name, "queued": "remove"}


def scale(h, name: str):
    lo, hi = h.body.get("min"), h.body.get("max")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
        raise Invalid("scale needs integer min and max")
    s = h.sched
    with s.lock:
        s.scale(name, lo, hi, s.clock())
    h.audit(name, min=lo, max=hi)
    return 202, {"model": name, "min": lo, "max": hi, "queued": "scale"}


def retry(h, name: str):
    with h.sched.lock:
        h.sched.retry(name)
    h.audit(name)
    return 202, {"model": name, "queued": "retry"}


def drain(h, name: str):
    s = h.sched
    with s.lock:
        s.drain(name, s.clock())
    h.audit(name)
    return 202, {"node": name, "queued": "drain"}


def undrain(h, name: str):
    with h.sched.lock:
        h.sched.undrain(name)
    h.audit(name)
    return 202, {"node": name, "queued": "undrain"}


def restart(h):
    """POST /v1/restarts: {"replicas": [...]} | {"model": M} | {"all": true}, with
    optional max_surge, max_unavailable and in_place."""
    body = h.body
    opts = {"max_surge": body.get("max_surge", 1), "max_unavailable":
            body.get("max_unavailable", 1)}  # fmt: skip
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in opts.values()):  # fmt: skip
        raise Invalid("max_surge and max_unavailable must be integers >= 0")
    in_place = body.get("in_place", False) is True
    if in_place and opts["max_unavailable"] < 1:
        raise Invalid("in_place needs max_unavailable >= 1")
    if opts["max_surge"] + opts["max_unavailable"] == 0:
        raise Invalid("max_surge and max_unavailable cannot both be 0")
    chosen = [k for k in ("replicas", "model", "all") if body.get(k)]
    if len(chosen) != 1:
        raise Invalid("say which: replicas (a list of ids), model, or all")
    s = h.sched
    with s.lock:
        live = [r for r in s.inv.replicas.values() if r.state in LIVE]
        if chosen == ["replicas"]:
            ids = body["replicas"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise Invalid("replicas must be a list of ids")
        elif chosen == ["model"]:
            s.model(body["model"])
            ids = [r.id for r in sorted(live, key=lambda r: r.since)
                   if r.model == body["model"]]  # fmt: skip
        else:
            ids = [r.id for r in sorted(live, key=lambda r: (r.model, r.since))]
        jobs = s.restart(ids, s.clock(), in_place=in_place, **opts)
        out = [View.restart(j) for j in jobs]
    h.audit(",".join(ids), in_place=in_place or None, **opts)
    return 202, {"queued": out}
