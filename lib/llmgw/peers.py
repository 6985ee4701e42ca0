"""Who may join the bus: a name, its kind (agent or router) and its CURVE public key.

The keypair is made in the scheduler's key directory (<config_dir>/pki/curve); its
secret half and the scheduler's public key are what the peer needs, copied there by
the operator or written by `llmgw nodes add NAME --out DIR`.
"""

import json
import time
from pathlib import Path

import zmq.auth

from llmgw import bus, dirs
from llmgw.errors import Error
from llmgw.store import (
    AuditEntry,
    BusPeer,
    DrainedNode,
    NodeAccess,
    ReplicaIntent,
    db_proxy,
    drop_connection,
)

KINDS = ("agent", "router")
# The audit actions of a removal: each entry carries the revoked public key.
REMOVALS = ("nodes.remove", "routers.remove")


def name_of(public_key: str, logger, kind: str | None = None) -> str | None:
    """A registered peer's name (of `kind`, if given), read from the store on the bus
    authenticator's thread, on the one connection that thread keeps (opened at its
    first lookup, and again only after an error) rather than a new database session for
    every unknown key's handshake. None for a key not registered, or a store that is
    down (said on `logger`; the peer retries)."""
    query = BusPeer.public_key == public_key
    if kind is not None:
        query &= BusPeer.kind == kind
    try:
        peer = BusPeer.get_or_none(query)
    except Exception as e:  # the store is down: the peer retries, we say why
        logger.warning("peer_lookup_failed", reason=str(e)[:200])
        drop_connection()
        return None
    return peer.name if peer else None


class PeerError(Error):
    """A peer cannot be registered as asked."""


def peer_json(p: BusPeer) -> dict:
    return {"name": p.name, "kind": p.kind, "public_key": p.public_key, "created_at": p.created_at}


def register(keys_dir: Path, name: str, kind: str, now: float | None = None) -> BusPeer:
    """Make NAME's keypair (unless there) and record its public key; idempotent."""
    if kind not in KINDS:
        raise PeerError(f"kind must be one of {', '.join(KINDS)}")
    if not name or "/" in name or name.startswith(".") or bus.is_reserved(name) or len(name) > 100:
        raise PeerError(f"{name!r} cannot be a name")
    try:
        bus.create_keypair(keys_dir, bus.SCHEDULER)  # agents and routers need its public key
        _drop_if_revoked(keys_dir, name)
        public = bus.create_keypair(keys_dir, name)
    except dirs.DirError as e:  # names the directory and the fix already
        raise PeerError(str(e)) from None
    except (OSError, bus.BusError) as e:
        raise PeerError(f"cannot write keys under {keys_dir}: {e}") from None
    existing = BusPeer.get_or_none(BusPeer.name == name)
    if existing is not None and existing.public_key != public:
        raise PeerError(
            f"{name} is registered with another key; remove it first (or use another name)"
        )
    if existing is not None and existing.kind != kind:
        raise PeerError(f"{name} is registered as an {existing.kind}, not a {kind}")
    if existing is None:
        BusPeer.create(
            name=name, kind=kind, public_key=public, created_at=time.time() if now is None else now
        )
    return BusPeer.get(BusPeer.name == name)


def _drop_if_revoked(keys_dir: Path, name: str) -> None:
    """A copy this machine kept of a removed peer's keypair (it was down when the other
    scheduler removed it): an `add` of the name must make a new key, not let the old one
    back in."""
    left = keypair_public(keys_dir, name)
    if (
        left is not None
        and revoked(left)
        and BusPeer.get_or_none(BusPeer.public_key == left) is None
    ):
        drop_keypair(keys_dir, name, left)


def remove(keys_dir: Path, name: str, kind: str) -> BusPeer:
    """Forget NAME: its row, what the store keeps about it as a node (its drain, the
    start intents of replicas placed on it, how it was onboarded) and, here, its keypair
    files, so that adding the name again makes a new key rather than letting the old one
    back in; return what it was. The caller's audit entry must carry the public key
    (`removal_detail`): that is how the other scheduler drops its own copy."""
    peer = BusPeer.get_or_none(BusPeer.name == name)
    group = "nodes" if kind == "agent" else "routers"
    if peer is None or peer.kind != kind:
        raise PeerError(f"no {kind} {name} is registered (see `llmgw {group} list`)")
    with db_proxy.atomic():
        BusPeer.delete().where(BusPeer.name == name).execute()
        if kind == "agent":
            DrainedNode.delete().where(DrainedNode.name == name).execute()
            ReplicaIntent.delete().where(ReplicaIntent.node == name).execute()
            NodeAccess.delete().where(NodeAccess.node == name).execute()
    drop_keypair(keys_dir, name, peer.public_key)
    return peer


def removal_detail(peer: BusPeer) -> dict:
    """What a removal's audit entry says beyond who and what: the public half of the
    revoked key (never the secret), which every scheduler reads (`removed_since`)."""
    return {"public_key": peer.public_key}


def keypair_public(keys_dir: Path, name: str) -> str | None:
    """The public key NAME's keypair files here hold (None: none, or unreadable)."""
    for file in (keys_dir / f"{name}.key_secret", keys_dir / f"{name}.key"):
        if file.exists():
            try:
                return zmq.auth.load_certificate(str(file))[0].decode()
            except (OSError, ValueError):
                continue
    return None


def drop_keypair(keys_dir: Path, name: str, public_key: str) -> bool:
    """Delete NAME.key and NAME.key_secret from `keys_dir` if they hold `public_key`, the
    revoked one; True if they did. A revoked secret kept on the control plane is only a
    liability (it is in every backup of the directory, and an `add` of the name that
    found it would let the old key back in), and the audit entry keeps its public half,
    so nothing is kept. Files of another key under the name are not this removal's."""
    if bus.is_reserved(name) or keypair_public(keys_dir, name) != public_key:
        return False
    for file in (keys_dir / f"{name}.key", keys_dir / f"{name}.key_secret"):
        try:
            file.unlink(missing_ok=True)
        except OSError:
            return False  # the row is what lets it in; a file we may not delete lets in nothing
    return True


def removed_since(after_id: int) -> tuple[list[tuple[str, str]], int]:
    """The (name, public key) of every peer removed after audit entry `after_id`, and the
    newest entry's id to ask after next time. Entries from before removals carried the
    key say nothing here."""
    rows = list(
        AuditEntry.select(AuditEntry.id, AuditEntry.target, AuditEntry.detail)
        .where((AuditEntry.id > after_id) & AuditEntry.action.in_(REMOVALS))
        .order_by(AuditEntry.id)
    )
    out = []
    for row in rows:
        try:
            public = json.loads(row.detail or "{}").get("public_key")
        except (ValueError, AttributeError):
            public = None
        if isinstance(public, str) and public:
            out.append((row.target, public))
    return out, rows[-1].id if rows else after_id


def revoked(public_key: str) -> bool:
    """Whether a removal's audit entry names `public_key` (removals are few: read them)."""
    return any(public == public_key for _, public in removed_since(0)[0])


def key_files(keys_dir: Path, name: str) -> dict[str, str]:
    """The files a peer needs, by name: its keypair and the scheduler's public key."""
    return {
        f"{name}.key_secret": (keys_dir / f"{name}.key_secret").read_text(),
        f"{bus.SCHEDULER}.key": (keys_dir / f"{bus.SCHEDULER}.key").read_text(),
    }


def listing(kind: str) -> list[dict]:
    return [
        peer_json(p) for p in BusPeer.select().where(BusPeer.kind == kind).order_by(BusPeer.name)
    ]
