"""Numbered migrations, applied in order and recorded in `llmgw_migrations`.

A migration is a function `mNNN_name(db)`; add new ones at the end of MIGRATIONS and
never edit one that has shipped. Each runs in a transaction with its record, so a
failed migration leaves nothing half-applied (on PostgreSQL; SQLite DDL is
transactional too).
"""

import time

import peewee

from llmgw.store import models as m


def m001_initial(db: peewee.Database) -> None:
    db.create_tables([m.ApiKey, m.Usage])


def m002_scheduler(db: peewee.Database) -> None:
    db.create_tables([m.BusPeer, m.ClusterSecret, m.MeasuredCapacity])


def m003_parking(db: peewee.Database) -> None:
    db.create_tables([m.ParkedModel])


def m004_drains(db: peewee.Database) -> None:
    db.create_tables([m.DrainedNode])


def m005_runtime_models(db: peewee.Database) -> None:
    db.create_tables([m.RuntimeModel, m.ModelScale])


def m006_audit_log(db: peewee.Database) -> None:
    db.create_tables([m.AuditEntry])


def m007_tenancy(db: peewee.Database) -> None:
    """Orgs, teams, projects and users; limits and budgets and the routers' counters;
    who each key and usage row belongs to; daily usage rollups."""
    from playhouse.migrate import SchemaMigrator, migrate

    from llmgw.store import tenancy as t

    db.create_tables(t.TABLES)
    # m001 creates api_keys and usage from today's models, which have these columns
    # already; a store made before m007 gets them added.
    mig = SchemaMigrator.from_database(db)
    adds = []
    for model, fields in ((m.ApiKey, ("user", "project", "band")),
                          (m.Usage, ("user", "project", "team", "org", "cost"))):  # fmt: skip
        table = model._meta.table_name
        have = {c.name for c in db.get_columns(table)}
        adds += [mig.add_column(table, f, getattr(model, f)) for f in fields if f not in have]
    migrate(*adds)


def m008_leadership(db: peewee.Database) -> None:
    db.create_tables([m.Lease, m.SchedulerSeen, m.ReplicaIntent])


def m009_usage_row_id(db: peewee.Database) -> None:
    """usage.row_id, unique: each row's own id, so replaying a router's usage spool
    after a crash inserts every row once."""
    # A store whose usage table was made from the peewee model (m001 before it spelled
    # out its DDL) has the column and index already.
    if "row_id" not in {c.name for c in db.get_columns("usage")}:
        db.execute_sql("ALTER TABLE usage ADD COLUMN row_id VARCHAR(32)")
    db.execute_sql("CREATE UNIQUE INDEX IF NOT EXISTS usage_row_id ON usage (row_id)")


MIGRATIONS = [
    m001_initial,
    m002_scheduler,
    m003_parking,
    m004_drains,
    m005_runtime_models,
    m006_audit_log,
    m007_tenancy,
    m008_leadership,
    m009_usage_row_id,
]


def _applied(db: peewee.Database) -> set[str]:
    db.create_tables([m.Migration], safe=True)
    return {row.name for row in m.Migration.select(m.Migration.name)}


def pending(db: peewee.Database) -> list[str]:
    done = _applied(db)
    return [f.__name__ for f in MIGRATIONS if f.__name__ not in done]


def migrate(db: peewee.Database) -> list[str]:
    """Apply every pending migration; return the names applied."""
    done = _applied(db)
    applied = []
    for step in MIGRATIONS:
        if step.__name__ in done:
            continue
        with db.atomic():
            step(db)
            m.Migration.create(name=step.__name__, applied_at=time.time())
        applied.append(step.__name__)
    return applied
