"""The admin API's tenancy resources: orgs, teams, projects and users; limits and
budgets; usage reports and the rollup.

Like registry.py these change the store, not the scheduler's state, so they take no
scheduler lock. Every change goes through `h._change`, which writes the audit log.
Routers pick changes up from the store within `router.limits_refresh_s`.
"""

import time
from urllib.parse import parse_qs

from llmgw import tenancy, usage
from llmgw.errors import TenancyError

# URL collection -> the kind of record it holds.
COLLECTIONS = {"orgs": "org", "teams": "team", "projects": "project", "users": "user"}
_STATUS = {"invalid": 400, "not_found": 404, "conflict": 409}


def _query(query: str) -> dict:
    return {k: v[-1] for k, v in parse_qs(query).items()}


def _fail(h, e: TenancyError) -> None:
    h._error(_STATUS.get(e.kind, 400), f"tenancy_{e.kind}", str(e))


def _bands(h) -> list[str] | None:
    return list(h.cfg.router.bands) if h.cfg is not None else None


def get(h, parts: list[str], query: str) -> bool:
    """Answer a GET on our resources; False if the path is not ours."""
    q, now = _query(query), time.time()
    try:
        if len(parts) == 2 and parts[0] == "v1" and parts[1] in COLLECTIONS:
            h._send(200, tenancy.listing(COLLECTIONS[parts[1]], q.get("org")))
        elif len(parts) == 3 and parts[0] == "v1" and parts[1] in COLLECTIONS:
            h._send(200, tenancy.show(COLLECTIONS[parts[1]], parts[2], now))
        elif parts == ["v1", "limits"]:
            h._send(200, tenancy.limits(q.get("scope")))
        elif parts == ["v1", "budgets"]:
            h._send(200, tenancy.budgets(q.get("scope"), q.get("subject"), now=now))
        elif parts == ["v1", "usage"]:
            by = q.get("by", "key")
            try:
                since = float(q.get("since", now - 7 * 86400))
                rows = usage.report(by, since, now)
            except ValueError as e:
                h._error(400, "invalid_value", str(e))
                return True
            h._send(200, rows)
        else:
            return False
    except TenancyError as e:
        _fail(h, e)
    return True


def post(h, parts: list[str]) -> bool:
    """Answer a POST that changes our resources; False if the path is not ours.

    Removals are POSTs too, as `POST /v1/keys/revoke` is: `/v1/orgs/NAME/remove`,
    `/v1/limits/remove`, `/v1/budgets/remove`."""
    collection = len(parts) >= 2 and parts[0] == "v1" and parts[1] in COLLECTIONS
    ours = (
        (collection and len(parts) == 2)
        or (collection and len(parts) == 4 and parts[3] == "remove")
        or (len(parts) == 4 and parts[:2] == ["v1", "projects"] and parts[3] == "band")
        or parts
        in (
            ["v1", "limits"],
            ["v1", "limits", "remove"],
            ["v1", "budgets"],
            ["v1", "budgets", "remove"],
            ["v1", "usage", "rollup"],
        )
    )
    if not ours:
        return False
    body = h._body()
    if body is None:
        return True
    try:
        _post(h, parts, body, time.time())
    except TenancyError as e:
        _fail(h, e)
    return True


def _post(h, parts: list[str], body: dict, now: float) -> None:
    scope, subject = body.get("scope"), body.get("subject")
    target = f"{scope}:{subject}"
    if parts == ["v1", "limits"]:
        values = {k: body.get(k) for k in tenancy.LIMIT_KINDS}
        out = tenancy.set_limits(scope, subject, now, **values)
        h._change("limits.set", target, **values)
        h._send(200, out)
    elif parts == ["v1", "limits", "remove"]:
        kinds = body.get("kinds") or []
        if not isinstance(kinds, list):
            raise TenancyError("invalid", "kinds must be a list: rpm, tpm, concurrent")
        out = tenancy.remove_limits(scope, subject, now, kinds)
        h._change("limits.remove", target, kinds=kinds or None)
        h._send(200, out or {"scope": scope, "subject": subject, "removed": True})
    elif parts == ["v1", "budgets"]:
        period, tokens, cost = body.get("period"), body.get("tokens"), body.get("cost")
        out = tenancy.set_budget(scope, subject, period, now, tokens, cost)
        h._change("budgets.set", target, period=period, tokens=tokens, cost=cost)
        h._send(200, out)
    elif parts == ["v1", "budgets", "remove"]:
        n = tenancy.remove_budget(scope, subject, now, body.get("period"))
        h._change("budgets.remove", target, period=body.get("period"))
        h._send(200, {"scope": scope, "subject": subject, "removed": n})
    elif parts == ["v1", "usage", "rollup"]:
        days = body.get("retention_days")
        if days is None and h.cfg is not None:
            days = h.cfg.usage.retention_days
        if not isinstance(days, int) or isinstance(days, bool) or days < 0:
            raise TenancyError("invalid", "retention_days must be a whole number >= 0")
        out = usage.rollup(now, days)
        h._change("usage.rollup", "", retention_days=days, **out)
        h._send(200, out)
    elif len(parts) == 4 and parts[3] == "band":
        out = tenancy.set_band(parts[2], body.get("band"), now, _bands(h))
        h._change("projects.band", parts[2], band=out["band"])
        h._send(200, out)
    elif len(parts) == 4:
        tenancy.remove(COLLECTIONS[parts[1]], parts[2], now)
        h._change(f"{parts[1]}.remove", parts[2])
        h._send(200, {"kind": COLLECTIONS[parts[1]], "name": parts[2], "removed": True})
    else:
        kind = COLLECTIONS[parts[1]]
        out = tenancy.create(kind, body.get("name"), now, org=body.get("org"),
                             team=body.get("team"), band=body.get("band"),
                             bands=_bands(h))  # fmt: skip
        h._change(f"{parts[1]}.create", out["name"], org=out.get("org"),
                  team=out.get("team"), band=out.get("band"))  # fmt: skip
        h._send(201, out)
