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


def m008_leadership(db: peewee.Database) -> None:
    db.create_tables([m.Lease, m.SchedulerSeen, m.ReplicaIntent])


MIGRATIONS = [
    m001_initial,
    m002_scheduler,
    m003_parking,
    m004_drains,
    m005_runtime_models,
    m006_audit_log,
    m008_leadership,
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
