"""The ZeroMQ bus between scheduler, agents and routers: sockets, CURVE, message framing.

Every socket is CURVE-encrypted. The scheduler is the CURVE server on both of its
sockets (a ROUTER that agents connect DEALERs to, a PUB that routers subscribe to) and
lets in only public keys registered in the store; the registered name becomes the
message's authenticated sender (ZAP User-Id), so a peer cannot speak for another.

Keys live in <config_dir>/pki/curve/: NAME.key holds the public key, NAME.key_secret
both (pyzmq's certificate format). `llmgw nodes add NAME` makes and registers them.

A message is one JSON frame: {"v": 1, "type": ..., "from": ..., "epoch": ..., "body": {...}}.
"""

import json
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from llmgw import dirs, log
from llmgw.errors import Error

VERSION = 1
SCHEDULER = "scheduler"  # the scheduler's keypair name
# The scheduler's next keypair, during a rotation (`llmgw keys rotate-scheduler`): made
# by the scheduler, copied to every peer beside scheduler.key, then swapped in.
NEXT_SCHEDULER = "scheduler.next"
RETIRED_SCHEDULER = "scheduler.retired"
# The reason a restarted agent gives for a shard whose engine it did not find running
# (after a reboot, say): the node's doing, never its engine's, so not a failed start.
GONE_AFTER_AGENT_RESTART = "not running after agent restart"


class BusError(Error):
    """A bus message or key is malformed, missing or refused."""


# -- keys ---------------------------------------------------------------------------------


def create_keypair(directory: Path, name: str) -> str:
    """Create NAME.key / NAME.key_secret in `directory` unless present; return the public key."""
    secret_file = directory / f"{name}.key_secret"
    what = f"the CURVE keypair {name}.key*"
    try:
        if not secret_file.exists():
            dirs.writable(directory, what)
            zmq.auth.create_certificates(str(directory), name)
            secret_file.chmod(0o600)
    except OSError as e:  # a directory it may not even enter, or a file it may not write
        raise dirs.cannot_write(directory, e, what) from None
    return load_public(directory, name)


def is_reserved(name: str) -> bool:
    """Whether `name` is one of the scheduler's own keypairs, never a peer's."""
    return name in (SCHEDULER, NEXT_SCHEDULER, RETIRED_SCHEDULER)


def copy_hint(name: str, group: str = "nodes") -> str:
    """What to do about a peer's missing keys: they are made on the control plane."""
    return (
        f"run `llmgw {group} add {name}` on the control plane (or with --out DIR) and copy"
        f" {name}.key_secret and {SCHEDULER}.key here"
    )


def _missing(file: Path, what: str, hint: str) -> BusError:
    return BusError(f"no {what} at {file}: {hint}")


def load_keypair(directory: Path, name: str, group: str = "nodes") -> tuple[bytes, bytes]:
    """NAME's keypair; `group` (nodes, routers) names the command that makes it."""
    file = directory / f"{name}.key_secret"
    if not file.exists():  # pyzmq would say "Invalid certificate file", which it is not
        raise _missing(file, "CURVE keypair", copy_hint(name, group))
    try:
        public, secret = zmq.auth.load_certificate(str(file))
    except (OSError, ValueError) as e:
        raise BusError(f"cannot load CURVE keypair {file}: {e}") from None
    if not secret:
        raise BusError(f"{file} holds no secret key: copy {name}.key_secret, not {name}.key")
    return public, secret


def load_public(directory: Path, name: str, hint: str = "") -> str:
    file = directory / f"{name}.key"
    if not file.exists() and hint:
        raise _missing(file, "CURVE public key", hint)
    try:
        public, _ = zmq.auth.load_certificate(str(file))
    except (OSError, ValueError) as e:
        raise BusError(f"cannot load CURVE public key {file}: {e}") from None
    return public.decode()


def scheduler_keys(directory: Path) -> list[str]:
    """The scheduler public keys a peer trusts: scheduler.key, and scheduler.next.key
    while a rotation is under way. Read again whenever a handshake fails, so a peer
    follows a rotation without a restart."""
    keys = []
    for name in (SCHEDULER, NEXT_SCHEDULER):
        if (directory / f"{name}.key").exists():
            try:
                keys.append(load_public(directory, name))
            except BusError:
                continue  # half-copied: the other key may still do
    return list(dict.fromkeys(keys))


def other_key(directory: Path, current: str) -> str | None:
    """The trusted scheduler key to try after `current` failed its handshakes, or None
    when there is no other."""
    keys = scheduler_keys(directory)
    if current not in keys:
        return keys[0] if keys else None
    if len(keys) < 2:
        return None
    return keys[(keys.index(current) + 1) % len(keys)]


def rotate_scheduler_keys(directory: Path) -> str:
    """Make scheduler.next's keypair the scheduler's (the old one kept as
    scheduler.retired); return the new public key. Each file is replaced in a rename."""
    for suffix in (".key", ".key_secret"):
        current = directory / f"{SCHEDULER}{suffix}"
        nxt = directory / f"{NEXT_SCHEDULER}{suffix}"
        if not nxt.exists():
            raise BusError(f"no {nxt}: run `llmgw keys rotate-scheduler` first")
    for suffix in (".key", ".key_secret"):
        current = directory / f"{SCHEDULER}{suffix}"
        if current.exists():
            current.replace(directory / f"{RETIRED_SCHEDULER}{suffix}")
        (directory / f"{NEXT_SCHEDULER}{suffix}").replace(current)
    return load_public(directory, SCHEDULER)


# -- messages -----------------------------------------------------------------------------


def encode(type_: str, sender: str, body: dict, epoch: int = 0) -> bytes:
    return json.dumps(
        {"v": VERSION, "type": type_, "from": sender, "epoch": epoch, "body": body},
        separators=(",", ":"),
    ).encode()


def topic(type_: str) -> bytes:
    """The first bytes of every message of this type, as encode() writes it: what a SUB
    subscribes to for that type alone (ZeroMQ filters by prefix, at the publisher)."""
    return b'{"v":%d,"type":"%s",' % (VERSION, type_.encode())


def decode(data: bytes) -> dict:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise BusError("message is not JSON") from None
    if not isinstance(msg, dict):
        raise BusError("message is not a JSON object")
    if msg.get("v") != VERSION:
        raise BusError(f"unsupported message version {msg.get('v')!r}")
    if not isinstance(msg.get("type"), str) or not isinstance(msg.get("body"), dict):
        raise BusError("message lacks a type or a body")
    return msg


# -- authentication -----------------------------------------------------------------------


NOT_REGISTERED = "key not registered"


class PeerAuthenticator(ThreadAuthenticator):
    """ZAP handler: lets in registered public keys and names the peer after its key."""

    def __init__(self, context: zmq.Context, lookup=None, logger=None):
        super().__init__(context)
        self._peers: dict[bytes, str] = {}
        self._lock = threading.Lock()
        # Keys revoked so far: a list of peers read from the store before a revocation
        # must not be set after it (it would let the removed key in until the next read).
        self.revocations = 0
        # lookup(z85 key) -> name or None: asked for a key we do not know yet, so a peer
        # registered a moment ago gets in at its first try. libzmq does not retry a
        # connection the server refused, so being late here would shut it out for good.
        self._lookup = lookup
        self._log = logger or log.get("llmgw.bus")
        self._address = ""  # of the handshake being decided (one ZAP thread)
        # Keys refused and said so: an agent retrying every 5 s must not write a line
        # each time. Forgotten once the key gets in, so a later refusal is said again.
        self._refused: set[bytes] = set()

    def set_peers(self, peers: dict[str, str]) -> None:
        """Replace the allowed peers: {z85 public key: name}."""
        with self._lock:
            self._peers = {k.encode(): v for k, v in peers.items()}

    def revoke(self, public_key: str) -> None:
        """Refuse this key from now on (its peer was removed), not at the next refresh."""
        with self._lock:
            self._peers.pop(public_key.encode(), None)
            self.revocations += 1

    def allows(self, name: str) -> bool:
        """Whether a peer of that name may still speak (a removed one's connection,
        authenticated before, outlives its key)."""
        with self._lock:
            return name in self._peers.values()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode(errors="replace") if len(msg) > 3 else ""
        await super().handle_zap_message(msg)

    def callback(self, domain, key: bytes) -> bool:
        with self._lock:
            if key in self._peers:
                self._refused.discard(key)
                return True
        name = self._lookup(key.decode()) if self._lookup else None
        if name:
            with self._lock:
                self._peers[key] = name
            self._refused.discard(key)
        elif key not in self._refused:
            self._refused.add(key)
            self._log.warning(
                "peer_refused", reason=NOT_REGISTERED, key=key[:8].decode(), address=self._address
            )
        return bool(name)

    def curve_user_id(self, client_public_key: bytes) -> str:
        from zmq.utils import z85

        with self._lock:
            return self._peers.get(z85.encode(client_public_key), "unknown")

    def start_for(self) -> "PeerAuthenticator":
        self.start()
        self.configure_curve_callback(domain="*", credentials_provider=self)
        return self


def serve(ctx: zmq.Context, kind: int, bind: str, keys: tuple[bytes, bytes]) -> zmq.Socket:
    """A CURVE server socket (the scheduler's ROUTER or PUB)."""
    sock = ctx.socket(kind)
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.curve_server = True
    sock.linger = 0
    if kind == zmq.ROUTER:
        sock.router_mandatory = False
    try:
        sock.bind(bind)
    except zmq.ZMQError as e:
        sock.close()
        raise BusError(f"cannot bind {bind}: {e}") from None
    return sock


def connect(
    ctx: zmq.Context,
    kind: int,
    endpoints: list[str],
    keys: tuple[bytes, bytes],
    server_public: str,
    identity: str = "",
    topics: tuple[bytes, ...] = (b"",),
) -> zmq.Socket:
    """A CURVE client socket connected to every endpoint (an agent's DEALER, a router's
    SUB, subscribed to `topics`: everything unless told)."""
    sock = ctx.socket(kind)
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.curve_serverkey = server_public.encode()
    sock.linger = 0
    if identity:
        sock.routing_id = identity.encode()
    # A DEALER must not pile up messages for a scheduler that is away: they would all
    # arrive stale when it comes back. Heartbeats carry the full state anyway.
    if kind == zmq.DEALER:
        sock.sndhwm = 1000
        sock.immediate = True
    if kind == zmq.SUB:
        for t in topics:
            sock.setsockopt(zmq.SUBSCRIBE, t)
    for ep in endpoints:
        sock.connect(ep)
    return sock


# -- handshakes, as the connecting side sees them ---------------------------------------

HANDSHAKE_OK = "ok"
_WATCHED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
# A scheduler that goes away mid-handshake fails one too: only this many in a row,
# with no success between, mean the keys do not match.
FAILED_HANDSHAKES = 3


def handshake_outcome(event: int, value: int) -> str | None:
    """HANDSHAKE_OK, a reason the scheduler would not have us, or None (no news).

    libzmq 4.3 reports a ZAP refusal as HANDSHAKE_FAILED_AUTH with the status (400);
    a client holding the wrong scheduler.key sees HANDSHAKE_FAILED_NO_DETAIL (the server
    cannot read its hello, and just hangs up)."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return HANDSHAKE_OK
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return NOT_REGISTERED if value in (0, 400) else f"refused by the scheduler ({value})"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
        return "handshake failed: does scheduler.key hold this control plane's public key?"
    return None


class Handshakes:
    """One client socket's handshakes, through a ZeroMQ socket monitor: `news()` says
    whether the scheduler lets us in, once per change."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_WATCHED)
        self.refused: str | None = None  # the reason last said; None: not refused
        self._failures = 0

    def news(self) -> tuple[str, str] | None:
        """("refused", reason) or ("accepted", "") when that changed, else None."""
        news = None
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            outcome = handshake_outcome(event["event"], event["value"])
            if outcome == HANDSHAKE_OK:
                self._failures = 0
                if self.refused is not None:
                    self.refused, news = None, ("accepted", "")
            elif outcome is not None:
                self._failures += 1
                auth = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                if outcome != self.refused and (auth or self._failures >= FAILED_HANDSHAKES):
                    self.refused, news = outcome, ("refused", outcome)
        return news

    def forget(self) -> None:
        """Start afresh (another key is being tried): its refusal will be news."""
        self._failures, self.refused = 0, None

    def follow(self, sock: zmq.Socket) -> None:
        """Watch a fresh socket instead (after a reconnect), keeping what was said."""
        self.close()
        self.sock, self.monitor = sock, sock.get_monitor_socket(_WATCHED)

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass  # closed already
        self.monitor.close(0)


def sender_of(frame: zmq.Frame) -> str:
    """The authenticated name of the peer that sent `frame` (from the ZAP User-Id)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return "unknown"
