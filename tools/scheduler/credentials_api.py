"""Who may use the admin API: operators and their tokens, the bootstrap token, and this
scheduler's own bus keypair.

GET    /v1/operators              every operator (never a token)
GET    /v1/whoami                 the operator the request's token belongs to
POST   /v1/operators              {"name", "role"}: a new operator and its token, once
DELETE /v1/operators/NAME         its token stops working at once
POST   /v1/admin-token/rotate     a new bootstrap token for this scheduler
POST   /v1/scheduler-key/rotate   {"finish": bool}: the bus keypair, in two steps
"""

import os
import secrets
from pathlib import Path

from llmgw import bus, dirs, log, operators
from llmgw.dirs import DirError
from llmgw.errors import Conflict, Invalid
from llmgw_scheduler.errors import NotWritten

_log = log.get("llmgw.scheduler.admin")


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


def operators_list(h):
    return 200, operators.listing()


def whoami(h):
    """`via`: "token" (an operator's or the bootstrap token) or "oidc" (an ID token)."""
    return 200, {"name": h.who.name, "role": h.who.role, "via": h.who.via}


def operators_add(h):
    name, role = h.body.get("name"), h.body.get("role", operators.READ)
    if not isinstance(name, str) or not isinstance(role, str):
        raise Invalid("an operator needs a name and a role")
    op, token = operators.create(name, role)
    h.audit(name, role=role)
    return 201, {**op, "token": token}


def operators_remove(h, name: str):
    operators.remove(name)
    h.audit(name)
    return 200, {"name": name, "removed": True}


def rotate_token(h):
    """A new bootstrap token for this scheduler; the old one stops working now."""
    if h.cfg is None or h.cfg.scheduler.admin_token:
        raise Conflict(
            "scheduler.admin_token is set in the config: change it there and restart",
            "token_in_config",
        )
    try:
        token = rotate_admin_token(h.cfg)
    except (OSError, DirError) as e:
        raise NotWritten(f"cannot write the new token: {e}", "token_not_written") from None
    type(h).token = token  # the bound handler class: every later request
    h.audit(h.sched.name)
    return 200, {"scheduler": h.sched.name, "token": token}


def rotate_key(h):
    """Begin: make scheduler.next's keypair (once) for the operator to copy to every
    peer. Finish: serve with it from now on; the old key is kept as retired."""
    curve = h.cfg.curve_dir()
    try:
        if h.body.get("finish") is True:
            public = bus.rotate_scheduler_keys(curve)
            h.loop.rekey = bus.load_keypair(curve, bus.SCHEDULER)
            step = "finish"
        else:
            public = bus.create_keypair(curve, bus.NEXT_SCHEDULER)
            step = "begin"
    except (bus.BusError, DirError) as e:
        raise Conflict(str(e), "key_not_rotated") from None
    h.audit(h.sched.name, action=f"scheduler_key.{step}", public_key=public[:8])
    return 200, {"scheduler": h.sched.name, "step": step, "public_key": public,
                 "dir": str(curve)}  # fmt: skip
