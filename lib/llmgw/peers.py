"""Who may join the bus: a name, its kind (agent or router) and its CURVE public key.

The keypair is made in the scheduler's key directory (<config_dir>/pki/curve); its
secret half and the scheduler's public key are what the peer needs, copied there by
the operator or written by `llmgw nodes add NAME --out DIR`.
"""

import time
from pathlib import Path

from llmgw import bus, dirs
from llmgw.errors import Error
from llmgw.store import BusPeer, drop_connection

KINDS = ("agent", "router")


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
    if not name or "/" in name or name.startswith(".") or name == bus.SCHEDULER or len(name) > 100:
        raise PeerError(f"{name!r} cannot be a name")
    try:
        bus.create_keypair(keys_dir, bus.SCHEDULER)  # agents and routers need its public key
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


def remove(keys_dir: Path, name: str, kind: str) -> BusPeer:
    """Forget NAME (its row and, here, its keypair files, so that adding the name again
    makes a new key rather than letting the old one back in); return what it was."""
    peer = BusPeer.get_or_none(BusPeer.name == name)
    group = "nodes" if kind == "agent" else "routers"
    if peer is None or peer.kind != kind:
        raise PeerError(f"no {kind} {name} is registered (see `llmgw {group} list`)")
    BusPeer.delete().where(BusPeer.name == name).execute()
    for file in (keys_dir / f"{name}.key", keys_dir / f"{name}.key_secret"):
        try:
            file.unlink(missing_ok=True)
        except OSError:
            pass  # the row is what lets it in; a file we may not delete lets in nothing
    return peer


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
