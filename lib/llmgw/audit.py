"""The audit log: every change an operator makes, with who made it and from where.

The admin API records each change it applies; `llmgw ... --store`, which changes the
store directly when no scheduler runs yet, records its own. The actor is what the
client says it is (`user@host`); the token is what authorises it, so the actor is a
label for people reading the log, not proof.
"""

import json
import time

from llmgw.store import AuditEntry


def record(action: str, actor: str, client: str, target: str = "", now=None, **detail) -> None:
    AuditEntry.create(
        at=time.time() if now is None else now,
        actor=(actor or "unknown")[:200],
        client=client[:100],
        action=action[:64],
        target=(target or "")[:300],
        detail=json.dumps({k: v for k, v in detail.items() if v is not None}, sort_keys=True),
    )


def entry_json(row: AuditEntry) -> dict:
    """The one JSON shape of an audit entry."""
    return {
        "id": row.id,
        "at": row.at,
        "actor": row.actor,
        "client": row.client,
        "action": row.action,
        "target": row.target,
        "detail": json.loads(row.detail or "{}"),
    }


def recent(limit: int = 100, since: float | None = None, action: str | None = None) -> list[dict]:
    """The newest `limit` entries, oldest first."""
    q = AuditEntry.select()
    if since is not None:
        q = q.where(AuditEntry.at >= since)
    if action:
        q = q.where(AuditEntry.action.startswith(action))
    rows = list(q.order_by(AuditEntry.id.desc()).limit(limit))
    return [entry_json(r) for r in reversed(rows)]
