"""The admin API: HTTP/JSON on `scheduler.admin_listen`, one dispatcher over the route
table in routes.py.

For every request, in this order: match a route (404 for a path no route has, 405 for
one asked with another method), authenticate as the route's access says, refuse a
change on a standby (409 naming the leader), parse the JSON body once (400), run the
handler, and answer a refusal it raises with the status `STATUS` gives it. `llmgw` is
a thin client of it; so are agents (the weights mirror) and joining nodes.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from llmgw import audit, lease, log, oidc, operators, tracing
from llmgw.errors import Conflict, Invalid, NotFound, Refused, TenancyError
from llmgw.jointokens import TokenRefused
from llmgw_scheduler import join_api, metrics, mirror_api, page, routes
from llmgw_scheduler.credentials_api import admin_token, rotate_admin_token, token_path
from llmgw_scheduler.errors import (
    AgentSilent,
    BadBody,
    Forbidden,
    MethodNotAllowed,
    NotLeader,
    NotWritten,
    Unauthorized,
    Unavailable,
)
from llmgw_scheduler.fleet_api import View
from llmgw_scheduler.routes import ROUTES, Access

__all__ = ["Handler", "View", "admin_token", "rotate_admin_token", "serve", "token_path"]

_log = log.get("llmgw.scheduler.admin")

# The one place a refusal becomes an HTTP status; its code and message are the error's.
# The first class a refusal is an instance of decides.
STATUS = {
    Unauthorized: 401,
    Forbidden: 403,
    TokenRefused: 403,
    NotFound: 404,
    MethodNotAllowed: 405,
    Conflict: 409,
    Invalid: 400,
    NotWritten: 500,
    AgentSilent: 504,
}
# A tenancy change's refusal, by its kind; its code is `tenancy_<kind>`.
TENANCY_STATUS = {"invalid": 400, "not_found": 404, "conflict": 409}
MAX_BODY = 1 << 20


def status_of(e: Refused) -> int:
    return next((s for cls, s in STATUS.items() if isinstance(e, cls)), 400)


class Handler(BaseHTTPRequestHandler):
    server_version = "llmgw-scheduler"
    sched = None  # set by serve()
    token = ""
    cfg = None  # the whole config: where the bus keys live
    bus_auth = None
    loop = None
    routes = ROUTES
    signon = None  # signon.SignOn with [oidc] configured: ID tokens and page sessions

    # Set per request by the dispatcher, for the handler.
    url = None  # the request's path and query, split
    q: dict[str, str] = {}  # the query, each name's last value
    route = None
    params: dict[str, str] = {}  # the route's path params
    who = None  # who the route's access check says the caller is
    body = None  # the JSON object, for a route that takes one
    status_sent = None  # the status answered, for the request's span

    def log_message(self, fmt, *args):  # the audit of changes is logged by the scheduler
        pass

    def do_GET(self):
        self._traced("GET")

    def do_POST(self):
        self._traced("POST")

    def do_DELETE(self):
        self._traced("DELETE")

    def do_PUT(self):
        self._traced("PUT")

    def do_PATCH(self):
        self._traced("PATCH")

    def _traced(self, method: str) -> None:
        """The request, in a span of its own while tracing is on (llmgw.tracing): named
        for its route, the child of the caller's traceparent, with its status."""
        if tracing.tracer is None:
            return self._dispatch(method)
        self.status_sent = None
        with tracing.span(method, self.headers, server=True) as span:
            self._dispatch(method)
            if span.is_recording():
                route = self.route.path if self.route is not None else ""
                span.update_name(f"{method} {route}" if route else method)
                attrs = {"http.request.method": method, "url.path": urlsplit(self.path).path}
                if route:
                    attrs["http.route"] = route
                if self.status_sent is not None:
                    attrs["http.response.status_code"] = self.status_sent
                    if self.status_sent >= 500:
                        attrs["error.type"] = str(self.status_sent)
                if self.who is not None and self.who.name:
                    attrs["llmgw.operator"] = self.who.name
                span.set_attributes(attrs)

    def send_response(self, code, message=None):
        self.status_sent = code  # for the request's span
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        self.url = urlsplit(self.path)
        self.q = {k: v[-1] for k, v in parse_qs(self.url.query).items()}
        self.route = self.who = self.body = self._json = None
        self.params = {}
        parts = [unquote(p) for p in self.url.path.strip("/").split("/")]
        try:
            self.route, self.params = routes.match(self.routes, method, self.url.path, parts)
            self.who = AUTHENTICATE[self.route.access](self)
            if self.who is None:
                return  # answered already: the page's 401 or its redirect
            if self.route.leader:
                self._refuse_standby()
            if self.route.body:
                self.body = self.json_body()
            reply = self.route.handler(self, **self.params)
        except MethodNotAllowed as e:
            return self._error(405, e.code, str(e), {"Allow": ", ".join(e.allow)})
        except Unavailable as e:
            return self._error(503, e.code, str(e), {"Retry-After": str(round(e.retry_after))})
        except Refused as e:
            if isinstance(e, Unauthorized):  # counted, never written: see audit_refusal
                metrics.ADMIN_UNAUTHENTICATED.labels(self.route.access.value).inc()
            return self._error(status_of(e), e.code, str(e))
        except TenancyError as e:
            return self._error(TENANCY_STATUS.get(e.kind, 400), f"tenancy_{e.kind}", str(e))
        if reply is not None:
            self._send(*reply)

    def _send(self, status: int, body, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        self._send(status, {"error": {"message": message, "code": code}}, headers)

    # -- authentication ------------------------------------------------------------------

    def identify(self, token: str | None) -> operators.Who | None:
        """The operator a token belongs to: the bootstrap token, an operator's, or, with
        sign-on, the person an ID token names (oidc.SignOnError if it names nobody who
        may come in, saying why)."""
        if self.signon is not None and oidc.looks_like_jwt(token or ""):
            try:
                return self.signon.identify(token)
            except oidc.SignOnError as e:
                _log.info("signon_token_refused", reason=str(e)[:300],
                             client=self.client_address[0])  # fmt: skip
                raise
        try:
            return operators.identify(token or "", self.token)
        except Exception as e:  # the store is down: only the bootstrap token works
            _log.warning("operators_unavailable", reason=str(e).strip()[:200])
            return None

    def operator(self) -> operators.Who:
        """The bearer token's operator; an admin one for a route that needs admin."""
        given = self.headers.get("Authorization", "")
        try:
            who = self.identify(given[7:].strip()) if given.startswith("Bearer ") else None
        except oidc.NoRole as e:
            raise Forbidden(str(e), "no_role") from None
        except oidc.ProviderUnavailable as e:
            raise Unavailable(f"cannot check the ID token now: {e}", 5.0,
                              "signon_unavailable") from None  # fmt: skip
        except oidc.IdTokenRefused as e:
            raise Unauthorized(f"the ID token is refused: {e}") from None
        if who is None:
            raise Unauthorized("missing or wrong admin token")
        if self.route.access is Access.ADMIN and not who.may_change():
            why = f"operator '{who.name}' has the {who.role} role: changes need an admin token"
            self.audit_refusal(who, why)
            raise Forbidden(why)
        return who

    def anyone(self) -> operators.Who:
        return operators.Who("", "public")

    def json_body(self) -> dict:
        """The request's JSON object, read and parsed once; BadBody (400) if it is not one."""
        if self._json is None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length <= MAX_BODY else None
                body = json.loads(raw or b"{}") if raw is not None else None
            except ValueError:
                body = None
            if not isinstance(body, dict):
                raise BadBody("the request body must be a JSON object")
            self._json = body
        return self._json

    def _refuse_standby(self) -> None:
        """NotLeader, naming who leads, unless this scheduler leads."""
        s = self.sched
        if s.leading():
            return
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
        raise NotLeader(f"scheduler {s.name} is a standby: {where}")

    # -- the audit log -------------------------------------------------------------------

    def audit(self, target: str = "", action: str | None = None, **detail) -> None:
        """Log and keep one of the route's declared audit actions (its first by default):
        who (the operator whose token it was, and the label the client sends, e.g.
        `user@host`, which only says who typed it for the shared bootstrap token; a
        joining node is `join-token`), from where, what, when. A store that cannot take
        the entry does not undo the change; the log line still has it."""
        declared = self.route.audit
        action = action or (declared[0] if declared else "")
        if action not in declared:
            raise RuntimeError(f"{self.route} does not declare the audit action {action!r}")
        if self.route.access is Access.JOIN:
            actor = join_api.JOIN_TOKEN
        elif self.who is None or self.who.bootstrap:
            actor = self.headers.get("X-Llmgw-Actor", "")[:200] or operators.BOOTSTRAP
            detail["token"] = "bootstrap"
        else:
            actor = self.who.name
            detail["claimed"] = self.headers.get("X-Llmgw-Actor", "")[:200] or None
            detail.update(signed_on(self.who))
        client = self.client_address[0]
        _log.info("admin_change", action=action, target=target or None, actor=actor,
                  client=client, **detail)  # fmt: skip
        try:
            audit.record(action, actor, client, target, **detail)
        except Exception as e:  # the store is down: the journal keeps the change
            _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])

    def audit_refusal(self, who: operators.Who, why: str) -> None:
        """Keep a change an operator's good token may not make (a `read` token's): who
        tried it, from where, what (the route's audit action with `_refused`, the request
        line) and why not. Only an authenticated operator's: a missing or wrong token is
        counted in llmgw_admin_unauthenticated_total and never written, so whoever has no
        token cannot fill the store; an operator who floods it is named in every row."""
        declared = self.route.audit
        action = (declared[0] if declared else "change") + "_refused"
        target = "/".join(self.params.values())
        client = self.client_address[0]
        detail = {
            "refused": "forbidden",
            "role": who.role,
            "request": f"{self.command} {self.url.path}"[:300],
            "reason": why,
            "claimed": self.headers.get("X-Llmgw-Actor", "")[:200] or None,
            **signed_on(who),
        }
        _log.warning("admin_change_refused", action=action, target=target or None,
                     actor=who.name, client=client, role=who.role)  # fmt: skip
        try:
            audit.record(action, who.name, client, target, **detail)
        except Exception as e:  # the store is down: the journal keeps the attempt
            _log.error("audit_write_failed", action=action, target=target, reason=str(e)[:200])


def signed_on(who: operators.Who) -> dict:
    """What the audit log keeps of a person signed on through the identity provider:
    the actor is their email (else user name, else subject); `sub` is the subject,
    stable where an email can change hands."""
    return {"via": who.via, "sub": who.subject} if who.via == oidc.VIA else {}


# Each access kind's check: the caller's Who, Unauthorized/Forbidden/TokenRefused, or
# None once it has answered itself (the page's HTML).
AUTHENTICATE = {
    Access.PUBLIC: Handler.anyone,
    Access.SIGNON: Handler.anyone,
    Access.NODE: mirror_api.authenticate,
    Access.PEER: mirror_api.authenticate_peer,
    Access.JOIN: join_api.authenticate,
    Access.PAGE: page.authenticate,
    Access.READ: Handler.operator,
    Access.ADMIN: Handler.operator,
}


class AdminServer(ThreadingHTTPServer):
    """A thread per request. A client that gave up before its answer was written (a
    `llmgw` or a probe that timed out while a handler waited on a store that stopped
    answering) is no fault of ours: one debug line, not socketserver's traceback, which
    after a partition filled the log with one per client that had gone."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, ConnectionError):  # BrokenPipeError, ConnectionResetError
            _log.debug("admin_client_gone", client=client_address[0], reason=type(e).__name__)
            return
        super().handle_error(request, client_address)


def serve(sched, listen: str, token: str, ssl_context=None, cfg=None,
          bus_auth=None, loop=None, table=ROUTES, signon=None) -> ThreadingHTTPServer:  # fmt: skip
    """`bus_auth`: the bus's authenticator, told at once of a removed peer; `loop`: the
    bus loop, given a new keypair when the scheduler's key is rotated; `table`: the
    routes (a test's, to watch them); `signon`: sign-on through the identity provider,
    if configured."""
    host, _, port = listen.rpartition(":")
    handler = type("BoundHandler", (Handler,),
                   {"sched": sched, "token": token, "cfg": cfg, "bus_auth": bus_auth,
                    "loop": loop, "routes": table, "signon": signon})  # fmt: skip
    server = AdminServer((host or "127.0.0.1", int(port)), handler)
    if ssl_context is not None:
        # The handshake happens on the handler's thread, so a slow client cannot stall
        # accepting the others.
        server.socket = ssl_context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name="admin", daemon=True).start()
    return server
