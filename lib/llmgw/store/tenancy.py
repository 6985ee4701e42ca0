"""Tables for tenancy, limits, budgets, the routers' shared counters and usage rollups
(migration m007_tenancy).

Who: organisations hold teams, users and projects; a user or project may belong to a
team of its org. Every key belongs to a user and, optionally, a project. Names are the
ids: `llmgw users create ada --org acme`.

Limits and budgets are set on a (scope, subject): scope is key, user, project, team or
org, subject its id or name. The routers count against them in `limit_windows` (per
window) and `concurrency_holds` (slots held now), leased in chunks from a background
thread: see docs/limits.md.
"""

import peewee

from llmgw.store.models import BaseModel

SCOPES = ("key", "user", "project", "team", "org")
PERIODS = ("day", "month")


class Org(BaseModel):
    name = peewee.CharField(primary_key=True, max_length=200)
    created_at = peewee.DoubleField()
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "orgs"


class Team(BaseModel):
    name = peewee.CharField(primary_key=True, max_length=200)
    org = peewee.CharField(max_length=200, index=True)
    created_at = peewee.DoubleField()
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "teams"


class Project(BaseModel):
    name = peewee.CharField(primary_key=True, max_length=200)
    org = peewee.CharField(max_length=200, index=True)
    team = peewee.CharField(max_length=200, null=True)
    band = peewee.CharField(max_length=32, default="")  # "": the router's default band
    created_at = peewee.DoubleField()
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "projects"


class User(BaseModel):
    name = peewee.CharField(primary_key=True, max_length=200)
    org = peewee.CharField(max_length=200, index=True)
    team = peewee.CharField(max_length=200, null=True)
    created_at = peewee.DoubleField()
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "users"


class Limit(BaseModel):
    """Rate limits on one subject; None: no limit of that kind."""

    scope = peewee.CharField(max_length=16)
    subject = peewee.CharField(max_length=200)
    rpm = peewee.BigIntegerField(null=True)  # requests per minute
    tpm = peewee.BigIntegerField(null=True)  # tokens (prompt + completion) per minute
    concurrent = peewee.IntegerField(null=True)  # requests in flight at once
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "limits"
        primary_key = peewee.CompositeKey("scope", "subject")


class Budget(BaseModel):
    """What one subject may spend per period (UTC day or month), in tokens, in cost, or
    both; None: no budget of that unit."""

    scope = peewee.CharField(max_length=16)
    subject = peewee.CharField(max_length=200)
    period = peewee.CharField(max_length=8)
    tokens = peewee.BigIntegerField(null=True)
    cost = peewee.DoubleField(null=True)  # in the catalog's price unit (e.g. USD)
    updated_at = peewee.DoubleField(index=True)

    class Meta:
        table_name = "budgets"
        primary_key = peewee.CompositeKey("scope", "subject", "period")


class LimitWindow(BaseModel):
    """How much of one counter's window routers have leased. One atomic statement grows
    `leased` only while it stays within the limit, so the fleet can never hold more."""

    counter = peewee.CharField(max_length=300)  # e.g. "rpm:key:key_1a2b"
    window = peewee.BigIntegerField()  # the window's start, Unix seconds
    leased = peewee.BigIntegerField(default=0)
    granted = peewee.BigIntegerField(default=0)  # the last grant, read back by RETURNING
    ends_at = peewee.DoubleField(index=True)  # when the row can be pruned

    class Meta:
        table_name = "limit_windows"
        primary_key = peewee.CompositeKey("counter", "window")


class ConcurrencyHold(BaseModel):
    """Concurrency slots one router holds on a counter, until `expires_at` unless it
    renews them. The row with holder "" is the counter's lock: taking slots starts by
    writing it, so grants on one counter happen one at a time."""

    counter = peewee.CharField(max_length=300)
    holder = peewee.CharField(max_length=100)
    slots = peewee.IntegerField(default=0)
    expires_at = peewee.DoubleField()

    class Meta:
        table_name = "concurrency_holds"
        primary_key = peewee.CompositeKey("counter", "holder")


class UsageDaily(BaseModel):
    """Usage rolled up per UTC day and attribution, kept after the raw rows are pruned."""

    id = peewee.BigAutoField()
    day = peewee.DoubleField(index=True)  # the day's start, Unix seconds (UTC)
    key_id = peewee.CharField(max_length=32, null=True)
    user = peewee.CharField(max_length=200, null=True)
    project = peewee.CharField(max_length=200, null=True)
    team = peewee.CharField(max_length=200, null=True)
    org = peewee.CharField(max_length=200, null=True)
    model = peewee.CharField(max_length=200)  # as requested
    served_model = peewee.CharField(max_length=200, null=True)  # as answered
    requests = peewee.BigIntegerField()
    errors = peewee.BigIntegerField()  # answered with a status >= 400
    prompt_tokens = peewee.BigIntegerField()
    completion_tokens = peewee.BigIntegerField()
    cost = peewee.DoubleField(null=True)

    class Meta:
        table_name = "usage_daily"


class UsageDay(BaseModel):
    """A UTC day that has been rolled up: how many raw rows its rollup counts (a rollup
    that finds a different number counts the day again), and whether its raw rows have
    been pruned (then raw rows that arrive for it late are added to its rollup)."""

    day = peewee.DoubleField(primary_key=True)
    rolled_at = peewee.DoubleField()
    rows = peewee.BigIntegerField()
    pruned = peewee.BooleanField(default=False)

    class Meta:
        table_name = "usage_days"


TABLES = [
    Org,
    Team,
    Project,
    User,
    Limit,
    Budget,
    LimitWindow,
    ConcurrencyHold,
    UsageDaily,
    UsageDay,
]
