"""The admin API's tenancy resources: orgs, teams, projects and users; limits and
budgets; usage reports and the rollup.

Like registry.py these change the store, not the scheduler's state, so they take no
scheduler lock. Every change is audited (`h.audit`). A `TenancyError` is answered by
the dispatcher as 400, 404 or 409 by its kind. Routers pick changes up from the store
within `router.limits_refresh_s`. Removals are POSTs too, as `POST /v1/keys/revoke`
is: `/v1/orgs/NAME/remove`, `/v1/limits/remove`, `/v1/budgets/remove`.
"""

import time

from llmgw import tenancy, usage
from llmgw.errors import Invalid, TenancyError
from llmgw.store import db_proxy
from llmgw.store.timeouts import patient

# URL collection -> the kind of record it holds.
COLLECTIONS = {"orgs": "org", "teams": "team", "projects": "project", "users": "user"}


def _bands(h) -> list[str] | None:
    return list(h.cfg.router.bands) if h.cfg is not None else None


# -- reads ---------------------------------------------------------------------------


def listing(kind: str, h):
    return 200, tenancy.listing(kind, h.q.get("org"))


def show(kind: str, h, name: str):
    return 200, tenancy.show(kind, name, time.time())


def limits(h):
    return 200, tenancy.limits(h.q.get("scope"))


def budgets(h):
    return 200, tenancy.budgets(h.q.get("scope"), h.q.get("subject"), now=time.time())


def usage_report(h):
    now = time.time()
    try:
        since = float(h.q.get("since", now - 7 * 86400))
        with patient(db_proxy.obj):  # a long report is not a store that stopped answering
            rows = usage.report(h.q.get("by", "key"), since, now)
    except ValueError as e:
        raise Invalid(str(e)) from None
    return 200, rows


# -- changes -------------------------------------------------------------------------


def create(coll: str, h):
    body = h.body
    out = tenancy.create(COLLECTIONS[coll], body.get("name"), time.time(), org=body.get("org"),
                         team=body.get("team"), band=body.get("band"),
                         bands=_bands(h))  # fmt: skip
    h.audit(out["name"], org=out.get("org"), team=out.get("team"), band=out.get("band"))
    return 201, out


def remove(coll: str, h, name: str):
    tenancy.remove(COLLECTIONS[coll], name, time.time())
    h.audit(name)
    return 200, {"kind": COLLECTIONS[coll], "name": name, "removed": True}


def band(h, name: str):
    out = tenancy.set_band(name, h.body.get("band"), time.time(), _bands(h))
    h.audit(name, band=out["band"])
    return 200, out


def _target(h) -> tuple[object, object, str]:
    scope, subject = h.body.get("scope"), h.body.get("subject")
    return scope, subject, f"{scope}:{subject}"


def limits_set(h):
    scope, subject, target = _target(h)
    values = {k: h.body.get(k) for k in tenancy.LIMIT_KINDS}
    out = tenancy.set_limits(scope, subject, time.time(), **values)
    h.audit(target, **values)
    return 200, out


def limits_remove(h):
    scope, subject, target = _target(h)
    kinds = h.body.get("kinds") or []
    if not isinstance(kinds, list):
        raise TenancyError("invalid", "kinds must be a list: rpm, tpm, concurrent")
    out = tenancy.remove_limits(scope, subject, time.time(), kinds)
    h.audit(target, kinds=kinds or None)
    return 200, out or {"scope": scope, "subject": subject, "removed": True}


def budgets_set(h):
    scope, subject, target = _target(h)
    period, tokens, cost = h.body.get("period"), h.body.get("tokens"), h.body.get("cost")
    out = tenancy.set_budget(scope, subject, period, time.time(), tokens, cost)
    h.audit(target, period=period, tokens=tokens, cost=cost)
    return 200, out


def budgets_remove(h):
    scope, subject, target = _target(h)
    n = tenancy.remove_budget(scope, subject, time.time(), h.body.get("period"))
    h.audit(target, period=h.body.get("period"))
    return 200, {"scope": scope, "subject": subject, "removed": n}


def rollup(h):
    days = h.body.get("retention_days")
    if days is None and h.cfg is not None:
        days = h.cfg.usage.retention_days
    if not isinstance(days, int) or isinstance(days, bool) or days < 0:
        raise TenancyError("invalid", "retention_days must be a whole number >= 0")
    with patient(db_proxy.obj):
        out = usage.rollup(time.time(), days)
    h.audit("", retention_days=days, **out)
    return 200, out
