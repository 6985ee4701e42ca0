"""The admin API: HTTP/JSON on `scheduler.admin_listen`, bearer-token authenticated.

`llmgw` is a thin client of it. Reads take a consistent snapshot under the scheduler's
lock; changes are applied under the same lock and answered 202 when they take effect
on the next pass (a queued change is not an error).
"""

import json
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from llmgw import audit, bus, dirs, lease, log, operators, topology
from llmgw.dirs import DirError
from llmgw.errors import Conflict, Invalid, NotFound, Refused
from llmgw.jointokens import TokenRefused
from llmgw.placement import place
from llmgw.states import LIVE, LOST, ShardState
from llmgw.store import BusPeer
from llmgw_scheduler import (
    fabric_api,
    join_api,
    mirror_api,
    onboarding_api,
    page,
    registry,
    releases_api,
    usage_check,
)

_log = log.get("llmgw.scheduler.admin")

# How long `llmgw logs` waits for the agent to answer.
LOGS_WAIT_S = 5.0
# The one place a refusal becomes an HTTP status; its code and message are the error's.
STATUS = {NotFound: 404, Conflict: 409, Invalid: 400, TokenRefused: 403}


def _status(e: Refused) -> int:
    return next((s for cls, s in STATUS.items() if isinstance(e, cls)), 400)


def admin_token(cfg) -> str:
    """scheduler.admin_token, or the token file made on first start (0600)."""
    if cfg.scheduler.admin_token:
        return cfg.scheduler.admin_token
    path = token_path(cfg)
    if not path.exists():
        _write_token(path)
        _log.info("admin_token_created", path=path)
    try:
        return path.read_text().strip()
    except OSError as e:
        raise DirError(f"cannot read the admin token {path}: {e.strerror}") from None


def token_path(cfg) -> Path:
    return Path(cfg.paths.config_dir) / "secrets" / "admin.token"


def rotate_admin_token(cfg) -> str:
    token = _write_token(token_path(cfg))
    _log.warning("admin_token_rotated", path=token_path(cfg))
    return token


def _write_token(path: Path) -> str:
    """A new token in `path`, 0600, replaced in one rename; a directory the scheduler
    cannot write is one line naming it and the fix (DirError)."""
    dirs.writable(path.parent, "the admin token")
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(path.name + ".part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        tmp.replace(path)
    except OSError as e:
        raise dirs.cannot_write(path.parent, e, "the admin token") from None
    return token


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
            "gpus": [] if n.lost else n.gpus, "engines": n.engines,
            "replicas": len(self.s.inv.on_node(n.id)),
            "last_seen": n.last_seen, "version": n.version or None,
            "disk_total": n.disk_total or None, "disk_free": n.disk_free or None,
            "fetching": [] if n.lost else n.fetching,
            "topology": n.topology,
        }  # fmt: skip

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

    def models(self) -> list[dict]:
        return [self.model(m) for m in self.s.models.values()]

    def replicas(self, model: str | None = None) -> list[dict]:
        now = self.s.clock()
        lost = self.s.inv.lost_nodes()
        return [
            {"id": r.id, "model": r.model, "node": r.node, "state": self.s.inv.state_of(r, lost),
             "endpoint": r.endpoint, "since": r.since, "created": r.created, "rss": r.rss,
             "reason": r.reason,
             "restart": self.s.restart_state(r.id), "stale": self.stale(r),
             "idle_s": _round(self.s.idle_s(r, now)),
             **({"shards": shards} if (shards := self.s.gangs.shards(r.id)) else {})}
            for r in sorted(self.s.inv.replicas.values() if model is None
                            else self.s.inv.of_model(model), key=lambda r: (r.model, r.since))
        ]  # fmt: skip

    def stale(self, r) -> bool:
        """Started with a profile (engine, source, args...) that has been edited since."""
        m = self.s.models.get(r.model)
        return bool(m is not None and r.profile and r.profile != m.profile_hash())

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
        need = self.s.needs.need(m)
        p = place(need, self.s.node_views(), explain=True)
        nodes = self.s.inv.nodes

        def link(n: str) -> str:
            # Which GPUs a tensor-parallel group would get there, and the link joining them.
            choice = topology.group_on_node(nodes[n].topology, nodes[n].gpus, need.gpus,
                                            need.memory)  # fmt: skip
            return choice.why if choice else ""

        return {
            "model": m.name,
            "need": {"memory": need.memory, "gpus": need.gpus, "engine": need.engine},
            "choice": p.node, "install": p.install,
            "nodes": [{"name": n, "fits": n not in p.reasons, "reason": p.reasons.get(n, ""),
                       "gpu_link": link(n)} for n in sorted(nodes)],
        }  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    server_version = "llmgw-scheduler"
    sched = None  # set by serve()
    token = ""
    cfg = None  # the whole config: where the bus keys live

    def log_message(self, fmt, *args):  # the audit of changes is logged by the scheduler
        pass

    def _send(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": {"message": message, "code": code}})

    who = None  # the operator the request's token belongs to, once authorised

    def identify(self, token: str | None) -> operators.Who | None:
        """The operator a token belongs to: the bootstrap token or an operator's."""
        try:
            return operators.identify(token or "", self.token)
        except Exception as e:  # the store is down: only the bootstrap token works
            _log.warning("operators_unavailable", reason=str(e).strip()[:200])
            return None

    def _authorised(self, change: bool = False) -> bool:
        given = self.headers.get("Authorization", "")
        who = self.identify(given[7:].strip()) if given.startswith("Bearer ") else None
        if who is None:
            self._error(401, "unauthorized", "missing or wrong admin token")
            return False
        if change and not who.may_change():
            self._error(
                403,
                "forbidden",
                f"operator '{who.name}' has the {who.role} role: changes need an admin token",
            )
            return False
        self.who = who
        return True

    def _answer(self, route) -> None:
        """Run a route; a refusal it raises is answered with its status, code and message."""
        try:
            route()
        except Refused as e:
            self._error(_status(e), e.code, str(e))

    def do_GET(self):
        self._answer(self._get)

    def do_POST(self):
        self._answer(self._post)

    def do_DELETE(self):
        self._answer(self._delete)

    def _get(self):
        url = urlsplit(self.path)
        if url.path in ("/", "/status"):
            return page.serve(self, url)  # for browsers: its own ways to authenticate
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if mirror_api.node_get(self, parts) or join_api.public_get(self, parts):
            return  # nodes, with their own credential or none
        if not self._authorised():
            return
        if parts == ["v1", "operators"]:
            return self._send(200, operators.listing())
        if parts == ["v1", "whoami"]:
            return self._send(200, {"name": self.who.name, "role": self.who.role})
        if any(api.get(self, parts) for api in (releases_api, mirror_api, onboarding_api)):
            return
        if registry.get(self, parts, url.query) or usage_check.get(self, parts, url.query):
            return
        s = self.sched
        with s.lock:
            view = View(s)
            if parts == ["v1", "status"]:
                body = {
                    "nodes": view.nodes(),
                    "models": view.models(),
                    "replicas": view.replicas(),
                    "restarts": [j for j in view.restarts() if j["state"] != "done"],
                    "control_plane": {"name": s.name, "epoch": s.epoch,
                                      "role": "leader" if s.leading() else "standby"},
                }  # fmt: skip
            elif parts == ["v1", "nodes"]:
                body = view.nodes()
            elif parts == ["v1", "models"]:
                body = view.models()
            elif parts == ["v1", "restarts"]:
                body = view.restarts()
            elif parts == ["v1", "replicas"]:
                model = parse_qs(url.query).get("model", [None])[0]
                body = view.replicas(model)
            elif (
                len(parts) == 6
                and parts[:2] == ["v1", "nodes"]
                and parts[3:4] == ["shards"]
                and parts[5] == "logs"
            ):
                return self._logs(parts[2], parts[4], url.query)
            elif len(parts) == 4 and parts[:2] == ["v1", "models"] and parts[3] == "placement":
                body = view.placement(s.model(parts[2]))
            else:
                return self._error(404, "not_found", f"no such endpoint: GET {url.path}")
        if parts == ["v1", "status"]:
            body["control_plane"].update(self._control_plane())
        self._send(200, body)

    def _control_plane(self) -> dict:
        """The lease and every scheduler, from the store (outside the scheduler's lock)."""
        s = self.sched
        if s.leadership is None:
            return {}
        try:
            held = lease.current(s.leadership.db)
            peers = lease.schedulers(s.leadership.db)
        except Exception as e:
            return {"store_error": str(e)[:200]}
        leader = None
        if held is not None and held.expires_in > 0:
            leader = {"name": held.name, "admin_url": held.admin_url, "epoch": held.epoch,
                      "expires_in": round(held.expires_in, 1)}  # fmt: skip
        return {"leader": leader, "schedulers": peers}

    def _logs(self, node: str, shard: str, query: str) -> None:
        """Ask the node's agent for a shard's output and wait a few seconds for it.
        Called with the scheduler's lock held; the wait happens without it."""
        s = self.sched
        s.connected(node)
        try:
            lines = int(parse_qs(query).get("lines", ["100"])[0])
        except ValueError:
            return self._error(400, "invalid_value", "lines must be a number")
        entry = s.ask_logs(node, shard, lines)
        s.lock.release()
        try:
            answered = entry["done"].wait(LOGS_WAIT_S)
        finally:
            s.lock.acquire()
            s.log_requests.pop(entry["request"], None)
        if not answered:
            return self._error(
                504, "agent_silent", f"node '{node}' did not answer within {LOGS_WAIT_S:g}s"
            )
        reply = entry["reply"]
        if reply.get("error"):
            return self._error(404, "shard_not_found", reply["error"])
        self._send(200, {"node": node, "id": shard, "lines": reply.get("lines", [])})

    def _body(self):
        """The request's JSON object, or None after answering 400."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length <= 1 << 20 else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._error(400, "invalid_json", "the request body must be a JSON object")
            return None
        return body

    def _change(self, action: str, target: str = "", **detail) -> None:
        """Every change is logged and kept in the audit log: who (the operator whose
        token it was, and the label the client sends, e.g. `user@host`, which only
        says who typed it for the shared bootstrap token), from where, what, when. A
        store that cannot take the entry does not undo the change; the log line still
        has it."""
        claimed = self.headers.get("X-Llmgw-Actor", "")[:200] or None
        who = self.who
        if who is None or who.bootstrap:
            actor = claimed or operators.BOOTSTRAP
            detail["token"] = "bootstrap"
        else:
            actor = who.name
            detail["claimed"] = claimed
        client = self.client_address[0]
        _log.info("admin_change", action=action, target=target or None, actor=actor,
                  client=client, **detail)  # fmt: skip
        try:
            audit.record(action, actor, client, target, **detail)
        except Exception as e:  # the store is down: the journal keeps the change
            _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])

    def _restart(self, body: dict) -> None:
        """POST /v1/restarts: {"replicas": [...]} | {"model": M} | {"all": true}, with
        optional max_surge, max_unavailable and in_place."""
        opts = {"max_surge": body.get("max_surge", 1), "max_unavailable":
                body.get("max_unavailable", 1)}  # fmt: skip
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in opts.values()):  # fmt: skip
            return self._error(400, "invalid_value",
                               "max_surge and max_unavailable must be integers >= 0")  # fmt: skip
        in_place = body.get("in_place", False) is True
        if in_place and opts["max_unavailable"] < 1:
            return self._error(400, "invalid_value", "in_place needs max_unavailable >= 1")
        if opts["max_surge"] + opts["max_unavailable"] == 0:
            return self._error(400, "invalid_value",
                               "max_surge and max_unavailable cannot both be 0")  # fmt: skip
        chosen = [k for k in ("replicas", "model", "all") if body.get(k)]
        if len(chosen) != 1:
            return self._error(400, "invalid_value",
                               "say which: replicas (a list of ids), model, or all")  # fmt: skip
        s = self.sched
        with s.lock:
            live = [r for r in s.inv.replicas.values() if r.state in LIVE]
            if chosen == ["replicas"]:
                ids = body["replicas"]
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    return self._error(400, "invalid_value", "replicas must be a list of ids")
            elif chosen == ["model"]:
                s.model(body["model"])
                ids = [r.id for r in sorted(live, key=lambda r: r.since)
                       if r.model == body["model"]]  # fmt: skip
            else:
                ids = [r.id for r in sorted(live, key=lambda r: (r.model, r.since))]
            jobs = s.restart(ids, s.clock(), in_place=in_place, **opts)
            out = [View.restart(j) for j in jobs]
        self._change("restart", ",".join(ids), in_place=in_place or None, **opts)
        self._send(202, {"queued": out})

    def _operators_add(self) -> None:
        body = self._body()
        if body is None:
            return
        name, role = body.get("name"), body.get("role", operators.READ)
        if not isinstance(name, str) or not isinstance(role, str):
            return self._error(400, "invalid_value", "an operator needs a name and a role")
        op, token = operators.create(name, role)
        self._change("operators.add", name, role=role)
        self._send(201, {**op, "token": token})

    def _operators_remove(self, name: str) -> None:
        operators.remove(name)
        self._change("operators.remove", name)
        self._send(200, {"name": name, "removed": True})

    def _rotate_token(self) -> None:
        """A new bootstrap token for this scheduler; the old one stops working now."""
        if self.cfg is None or self.cfg.scheduler.admin_token:
            return self._error(
                409,
                "token_in_config",
                "scheduler.admin_token is set in the config: change it there and restart",
            )
        try:
            token = rotate_admin_token(self.cfg)
        except (OSError, DirError) as e:
            return self._error(500, "token_not_written", f"cannot write the new token: {e}")
        type(self).token = token  # the bound handler class: every later request
        self._change("admin_token.rotate", self.sched.name)
        self._send(200, {"scheduler": self.sched.name, "token": token})

    def _rotate_key(self) -> None:
        """Begin: make scheduler.next's keypair (once) for the operator to copy to every
        peer. Finish: serve with it from now on; the old key is kept as retired."""
        body = self._body()
        if body is None:
            return
        curve = self.cfg.curve_dir()
        try:
            if body.get("finish") is True:
                public = bus.rotate_scheduler_keys(curve)
                self.loop.rekey = bus.load_keypair(curve, bus.SCHEDULER)
                step = "finish"
            else:
                public = bus.create_keypair(curve, bus.NEXT_SCHEDULER)
                step = "begin"
        except (bus.BusError, DirError) as e:
            return self._error(409, "key_not_rotated", str(e))
        self._change(f"scheduler_key.{step}", self.sched.name, public_key=public[:8])
        self._send(200, {"scheduler": self.sched.name, "step": step, "public_key": public,
                         "dir": str(curve)})  # fmt: skip

    def _standby(self) -> bool:
        """Answer a change sent to a standby with who leads; True if it was."""
        s = self.sched
        if s.leading():
            return False
        held = None
        if s.leadership is not None:
            try:
                held = lease.current(s.leadership.db)
            except Exception:  # the store is down: say so, without a leader's name
                held = None
        if held is not None and held.expires_in > 0:
            where = f"the leader is {held.name} at {held.admin_url} (epoch {held.epoch})"
        else:
            where = "no scheduler leads right now; try again in a few seconds"
        self._error(409, "not_leader", f"scheduler {s.name} is a standby: {where}")
        return True

    def _delete(self):
        if not self._authorised(change=True) or self._standby():
            return
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        if len(parts) == 3 and parts[:2] == ["v1", "operators"]:
            return self._operators_remove(parts[2])
        if registry.delete(self, parts, urlsplit(self.path).query):
            return
        if mirror_api.delete(self, parts):
            return
        s = self.sched
        if len(parts) == 3 and parts[:2] == ["v1", "models"]:
            with s.lock:
                s.remove_model(parts[2])
            self._change("models.remove", parts[2])
            return self._send(202, {"model": parts[2], "queued": "remove"})
        self._error(404, "not_found", f"no such endpoint: DELETE {self.path}")

    def _post(self):
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        if join_api.public_post(self, parts):  # a node with a join token
            return
        if not self._authorised(change=True):
            return
        if parts == ["v1", "admin-token", "rotate"]:
            return self._rotate_token()  # this scheduler's own file: a standby's too
        if parts == ["v1", "scheduler-key", "rotate"]:
            return self._rotate_key()  # this scheduler's own keypair: a standby's too
        if self._standby():
            return
        if parts == ["v1", "operators"]:
            return self._operators_add()
        apis = (registry, releases_api, mirror_api, join_api, onboarding_api, fabric_api)
        if any(api.post(self, parts) for api in apis):
            return
        s = self.sched
        if parts == ["v1", "models"]:
            body = self._body()
            if body is None:
                return
            with s.lock:
                m = s.add_model(body, s.clock())
                model = View(s).model(m)
            self._change("models.add", m.name)
            return self._send(201, model)
        if len(parts) == 4 and parts[:2] == ["v1", "models"] and parts[3] == "scale":
            body = self._body()
            if body is None:
                return
            lo, hi = body.get("min"), body.get("max")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
                return self._error(400, "invalid_value", "scale needs integer min and max")
            with s.lock:
                s.scale(parts[2], lo, hi, s.clock())
            self._change("models.scale", parts[2], min=lo, max=hi)
            return self._send(202, {"model": parts[2], "min": lo, "max": hi, "queued": "scale"})
        if parts == ["v1", "restarts"]:
            body = self._body()
            if body is not None:
                self._restart(body)
            return
        if len(parts) == 4 and parts[:2] == ["v1", "models"] and parts[3] == "retry":
            with s.lock:
                s.retry(parts[2])
            self._change("models.retry", parts[2])
            return self._send(202, {"model": parts[2], "queued": "retry"})
        if len(parts) == 4 and parts[:2] == ["v1", "nodes"] and parts[3] in ("drain", "undrain"):
            node, action = parts[2], parts[3]
            with s.lock:
                if action == "drain":
                    s.drain(node, s.clock())
                else:
                    s.undrain(node)
            self._change(f"nodes.{action}", node)
            return self._send(202, {"node": node, "queued": action})
        self._error(404, "not_found", f"no such endpoint: POST {self.path}")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def serve(sched, listen: str, token: str, ssl_context=None, cfg=None,
          bus_auth=None, loop=None) -> ThreadingHTTPServer:  # fmt: skip
    """`bus_auth`: the bus's authenticator, told at once of a removed peer; `loop`: the
    bus loop, given a new keypair when the scheduler's key is rotated."""
    host, _, port = listen.rpartition(":")
    handler = type("BoundHandler", (Handler,),
                   {"sched": sched, "token": token, "cfg": cfg, "bus_auth": bus_auth,
                    "loop": loop})  # fmt: skip
    server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), handler)
    if ssl_context is not None:
        # The handshake happens on the handler's thread, so a slow client cannot stall
        # accepting the others.
        server.socket = ssl_context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="admin", daemon=True).start()
    return server


def registered_nodes() -> list[str]:
    return [p.name for p in BusPeer.select(BusPeer.name).where(BusPeer.kind == "agent")]
