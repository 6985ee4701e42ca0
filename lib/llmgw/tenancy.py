"""Who uses the fleet, and what they may use: orgs, teams, projects, users, and the
limits and budgets set on them and on keys. Shared by the admin API and `llmgw ...
--store`; every function takes the time it acts at and raises TenancyError.

An org holds teams, users and projects; a user or a project may belong to one team of
its org. A key belongs to a user and, optionally, a project of the same org. The limits
that apply to a key are those of the key, its user, its project, their teams and their
org: every one must admit a request, so the tightest wins.
"""

import re

from llmgw import periods
from llmgw.errors import TenancyError
from llmgw.store import ApiKey
from llmgw.store import tenancy as tables
from llmgw.store.tenancy import SCOPES, Budget, LimitWindow, Org, Project, Team, User

LimitRow = tables.Limit
BUDGET_PERIODS = tables.PERIODS

KINDS = {"org": Org, "team": Team, "project": Project, "user": User}
LIMIT_KINDS = ("rpm", "tpm", "concurrent")
# A budget in cost is counted in millionths of the price unit: integers, like tokens.
COST_SCALE = 1_000_000
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,199}$")
_BAND = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def _bad(message: str) -> TenancyError:
    return TenancyError("invalid", message)


def _missing(kind: str, name: str) -> TenancyError:
    return TenancyError("not_found", f"no {kind} '{name}' (see `llmgw {kind}s list`)")


def check_name(name, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{what} must be 1-200 letters, digits or ._@+- and start alphanumeric")
    return name


def check_band(band, bands: list[str] | None) -> str:
    """A band name; "" means none. With `bands` (router.bands) it must be one of them."""
    if band in (None, ""):
        return ""
    if not isinstance(band, str) or not _BAND.match(band):
        raise _bad("band must be 1-32 lower-case letters, digits, _ or -")
    if bands and band not in bands:
        raise _bad(f"band '{band}' is not in router.bands ({', '.join(bands)})")
    return band


def _get(kind: str, name: str):
    row = KINDS[kind].get_or_none(KINDS[kind].name == name)
    if row is None:
        raise _missing(kind, name)
    return row


# -- orgs, teams, projects, users -----------------------------------------------------


def record_json(kind: str, row) -> dict:
    """The one JSON shape of an org, team, project or user."""
    out = {"kind": kind, "name": row.name, "created_at": row.created_at}
    if kind != "org":
        out["org"] = row.org
    if kind in ("project", "user"):
        out["team"] = row.team
    if kind == "project":
        out["band"] = row.band or None
    return out


def create(kind: str, name, now: float, org=None, team=None, band=None, bands=None) -> dict:
    """Create an org, team, project or user; its org (and team) must exist."""
    model = KINDS[kind]
    check_name(name)
    if model.get_or_none(model.name == name) is not None:
        raise TenancyError("conflict", f"{kind} '{name}' exists already")
    fields = {"name": name, "created_at": now, "updated_at": now}
    if kind != "org":
        if team and not org:
            org = _get("team", team).org
        if not org:
            raise _bad(f"a {kind} needs an org (--org)")
        _get("org", org)
        fields["org"] = org
    if kind in ("project", "user") and team:
        t = _get("team", team)
        if t.org != org:
            raise _bad(f"team '{team}' belongs to org '{t.org}', not '{org}'")
        fields["team"] = team
    elif team:
        raise _bad(f"a {kind} has no team")
    if band not in (None, ""):
        if kind != "project":
            raise _bad(f"a {kind} has no band (keys and projects have)")
        fields["band"] = check_band(band, bands)
    row = model.create(**fields)
    return record_json(kind, row)


def listing(kind: str, org: str | None = None) -> list[dict]:
    model = KINDS[kind]
    q = model.select().order_by(model.name)
    if org and kind != "org":
        q = q.where(model.org == org)
    return [record_json(kind, r) for r in q]


def show(kind: str, name: str, now: float) -> dict:
    """A record with its members (for orgs and teams), keys, limits and budgets."""
    row = _get(kind, name)
    out = record_json(kind, row)
    if kind in ("org", "team"):
        for member in ("team", "project", "user"):
            if kind == "team" and member == "team":
                continue
            model = KINDS[member]
            field = model.org if kind == "org" else model.team
            out[f"{member}s"] = [r.name for r in model.select().where(field == name)]
    if kind in ("user", "project"):
        field = ApiKey.user if kind == "user" else ApiKey.project
        keys = ApiKey.select().where(field == name, ApiKey.revoked_at.is_null())
        out["keys"] = [k.id for k in keys]
    out["limits"] = limit_json_of(kind, name)
    out["budgets"] = budgets(kind, name, now=now)
    return out


def remove(kind: str, name: str, now: float) -> None:
    """Remove a record nothing else refers to, with its limits and budgets."""
    _get(kind, name)
    users = []
    if kind in ("org", "team"):
        for member in ("team", "project", "user"):
            model = KINDS[member]
            field = model.org if kind == "org" else model.team
            if member == "team" and kind == "team":
                continue
            names = [r.name for r in model.select(model.name).where(field == name).limit(5)]
            if names:
                raise TenancyError(
                    "conflict", f"{kind} '{name}' still has {member}s: {', '.join(names)}"
                )
    else:
        field = ApiKey.user if kind == "user" else ApiKey.project
        users = [k.id for k in ApiKey.select().where(field == name, ApiKey.revoked_at.is_null())]
        if users:
            raise TenancyError(
                "conflict",
                f"{kind} '{name}' still has active keys: {', '.join(users[:5])}"
                " (revoke them first: `llmgw keys revoke`)",
            )
    KINDS[kind].delete().where(KINDS[kind].name == name).execute()
    LimitRow.delete().where(LimitRow.scope == kind, LimitRow.subject == name).execute()
    Budget.delete().where(Budget.scope == kind, Budget.subject == name).execute()


def set_band(name: str, band, now: float, bands=None) -> dict:
    """A project's band ("" clears it)."""
    row = _get("project", name)
    row.band = check_band(band, bands)
    row.updated_at = now
    row.save()
    return record_json("project", row)


def key_owner(user, project) -> tuple[str | None, str | None]:
    """Check a new key's user and project: both exist, and in one org."""
    if user is None and project is not None:
        raise _bad("a key with a project needs a user (--user)")
    if user is None:
        return None, None
    u = _get("user", check_name(user, "user"))
    if project is None:
        return u.name, None
    p = _get("project", check_name(project, "project"))
    if p.org != u.org:
        raise _bad(f"project '{p.name}' is in org '{p.org}', user '{u.name}' in '{u.org}'")
    return u.name, p.name


# -- limits ---------------------------------------------------------------------------


def _subject(scope: str, subject) -> str:
    if scope not in SCOPES:
        raise _bad(f"scope must be one of {', '.join(SCOPES)}")
    if scope == "key":
        if not isinstance(subject, str) or ApiKey.get_or_none(ApiKey.id == subject) is None:
            raise TenancyError("not_found", f"no key '{subject}' (see `llmgw keys list`)")
        return subject
    return _get(scope, check_name(subject, scope)).name


def _amount(name: str, value, integer: bool = True):
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if not ok or isinstance(value, bool) or value < 0:
        want = "a whole number" if integer else "a number"
        raise _bad(f"{name} must be {want} >= 0")
    return value


def limit_json(row) -> dict:
    """The one JSON shape of the limits on one subject."""
    return {
        "scope": row.scope,
        "subject": row.subject,
        "rpm": row.rpm,
        "tpm": row.tpm,
        "concurrent": row.concurrent,
        "updated_at": row.updated_at,
    }


def limit_json_of(scope: str, subject: str) -> dict | None:
    row = LimitRow.get_or_none(LimitRow.scope == scope, LimitRow.subject == subject)
    return limit_json(row) if row else None


def set_limits(scope: str, subject, now: float, **values) -> dict:
    """Set rpm, tpm and/or concurrent on a subject, keeping the kinds not given."""
    subject = _subject(scope, subject)
    given = {k: _amount(k, v) for k, v in values.items() if v is not None}
    unknown = set(given) - set(LIMIT_KINDS)
    if unknown:
        raise _bad(f"unknown limit {', '.join(sorted(unknown))}: want {', '.join(LIMIT_KINDS)}")
    if not given:
        raise _bad("say which limits: rpm, tpm and/or concurrent")
    row = LimitRow.get_or_none(LimitRow.scope == scope, LimitRow.subject == subject)
    if row is None:
        LimitRow.insert(scope=scope, subject=subject, updated_at=now, **given).execute()
    else:
        LimitRow.update(updated_at=now, **given).where(
            LimitRow.scope == scope, LimitRow.subject == subject
        ).execute()
    return limit_json_of(scope, subject)


def remove_limits(scope: str, subject, now: float, kinds=()) -> dict | None:
    """Remove some kinds of limit from a subject (all when `kinds` is empty)."""
    subject = _subject(scope, subject)
    row = LimitRow.get_or_none(LimitRow.scope == scope, LimitRow.subject == subject)
    if row is None:
        raise TenancyError("not_found", f"{scope} '{subject}' has no limits")
    kinds = list(kinds) or list(LIMIT_KINDS)
    if set(kinds) - set(LIMIT_KINDS):
        raise _bad(f"limits are {', '.join(LIMIT_KINDS)}")
    where = (LimitRow.scope == scope) & (LimitRow.subject == subject)
    if all(getattr(row, k) is None or k in kinds for k in LIMIT_KINDS):
        # Deleting bumps nothing: routers see removals by reloading the whole table.
        LimitRow.delete().where(where).execute()
        return None
    LimitRow.update(updated_at=now, **dict.fromkeys(kinds)).where(where).execute()
    return limit_json_of(scope, subject)


def limits(scope: str | None = None) -> list[dict]:
    q = LimitRow.select().order_by(LimitRow.scope, LimitRow.subject)
    if scope:
        q = q.where(LimitRow.scope == scope)
    return [limit_json(r) for r in q]


# -- budgets --------------------------------------------------------------------------


def counter(kind: str, scope: str, subject: str) -> str:
    """The name routers count under in the store: `tokens/day:user:ada`."""
    return f"{kind}:{scope}:{subject}"


def budget_json(row, now: float) -> dict:
    """The one JSON shape of a budget, with what has been taken from it this period
    (including what routers have leased and not yet spent)."""
    start, end = periods.window(row.period, now)
    used = {}
    for unit in ("tokens", "cost"):
        if getattr(row, unit) is None:
            continue
        lw = LimitWindow.get_or_none(
            LimitWindow.counter == counter(f"{unit}/{row.period}", row.scope, row.subject),
            LimitWindow.window == start,
        )
        taken = lw.leased if lw else 0
        used[unit] = taken / COST_SCALE if unit == "cost" else taken
    return {
        "scope": row.scope,
        "subject": row.subject,
        "period": row.period,
        "tokens": row.tokens,
        "cost": row.cost,
        "used": used,
        "period_start": start,
        "period_end": end,
        "updated_at": row.updated_at,
    }


def set_budget(scope: str, subject, period: str, now: float, tokens=None, cost=None) -> dict:
    subject = _subject(scope, subject)
    if period not in BUDGET_PERIODS:
        raise _bad(f"period must be one of {', '.join(BUDGET_PERIODS)}")
    tokens, cost = _amount("tokens", tokens), _amount("cost", cost, integer=False)
    if tokens is None and cost is None:
        raise _bad("a budget needs tokens and/or cost")
    where = (Budget.scope == scope) & (Budget.subject == subject) & (Budget.period == period)
    values = {k: v for k, v in (("tokens", tokens), ("cost", cost)) if v is not None}
    if Budget.get_or_none(where) is None:
        Budget.insert(scope=scope, subject=subject, period=period, updated_at=now,
                      **values).execute()  # fmt: skip
    else:
        Budget.update(updated_at=now, **values).where(where).execute()
    return budget_json(Budget.get(where), now)


def remove_budget(scope: str, subject, now: float, period: str | None = None) -> int:
    """Remove a subject's budgets (of one period, or all); how many went."""
    subject = _subject(scope, subject)
    where = (Budget.scope == scope) & (Budget.subject == subject)
    if period:
        where &= Budget.period == period
    n = Budget.delete().where(where).execute()
    if not n:
        raise TenancyError("not_found", f"{scope} '{subject}' has no such budget")
    return n


def budgets(scope: str | None = None, subject: str | None = None, now: float = 0.0) -> list:
    q = Budget.select().order_by(Budget.scope, Budget.subject, Budget.period)
    if scope:
        q = q.where(Budget.scope == scope)
    if subject:
        q = q.where(Budget.subject == subject)
    return [budget_json(r, now) for r in q]
