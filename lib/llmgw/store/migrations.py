"""Numbered migrations, applied in order and recorded in `llmgw_migrations`.

Each migration spells out its own DDL and imports no model. The models (models.py,
tenancy.py) are how today's code queries the tables; a migration is what it did to
them when it shipped. Built from the models, m001 would create today's tables, and
the next model edit would make a fresh store and an upgraded one differ.

To add one: write `mNNN_name(db)` at the end of this file with its DDL, append it to
MIGRATIONS, change the model to match, then run `python -m tests.store_schema` and
review the diff it makes to tests/fixtures/store_schema.json. Never edit a migration
that has shipped. tests/unit/test_migrations.py checks that a store saved at m006
upgrades to exactly the schema of a fresh one, and that every model field is a column.

DDL is written once, with placeholders for what the backends spell differently:
{DOUBLE}, {BIGINT}, {BOOL}, and {BIGAUTO} (a 64-bit auto-increment primary key).
Where a change itself differs (SQLite adds a NOT NULL column only by rebuilding the
table), the migration branches on `is_postgres(db)`. Each migration runs in a
transaction with its record, so a failed one leaves nothing half-applied (DDL is
transactional on both backends).
"""

import time

import peewee

from llmgw.store.timeouts import patient

TYPES = {
    "sqlite": {
        "DOUBLE": "REAL",
        "BIGINT": "INTEGER",
        "BOOL": "INTEGER",
        "BIGAUTO": "INTEGER NOT NULL PRIMARY KEY",
    },
    "postgresql": {
        "DOUBLE": "DOUBLE PRECISION",
        "BIGINT": "BIGINT",
        "BOOL": "BOOLEAN",
        "BIGAUTO": "BIGSERIAL NOT NULL PRIMARY KEY",
    },
}


def is_postgres(db: peewee.Database) -> bool:
    return isinstance(db, peewee.PostgresqlDatabase)


def run(db: peewee.Database, *statements: str) -> None:
    """Execute each statement with the backend's types filled in."""
    types = TYPES["postgresql" if is_postgres(db) else "sqlite"]
    for sql in statements:
        db.execute_sql(sql.format(**types))


def m001_initial(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE api_keys (
            id VARCHAR(32) NOT NULL PRIMARY KEY,
            name VARCHAR(200) NOT NULL,
            secret_hash VARCHAR(64) NOT NULL,
            prefix VARCHAR(32) NOT NULL,
            models TEXT NOT NULL,
            created_at {DOUBLE} NOT NULL,
            expires_at {DOUBLE},
            revoked_at {DOUBLE},
            updated_at {DOUBLE} NOT NULL)""",
        "CREATE UNIQUE INDEX apikey_secret_hash ON api_keys (secret_hash)",
        "CREATE INDEX apikey_updated_at ON api_keys (updated_at)",
        """CREATE TABLE usage (
            id {BIGAUTO},
            at {DOUBLE} NOT NULL,
            request_id VARCHAR(64) NOT NULL,
            key_id VARCHAR(32),
            model VARCHAR(200) NOT NULL,
            served_model VARCHAR(200),
            endpoint VARCHAR(200),
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            status INTEGER NOT NULL,
            latency_ms {DOUBLE} NOT NULL,
            ttft_ms {DOUBLE})""",
        "CREATE INDEX usage_at ON usage (at)",
        "CREATE INDEX usage_key_id ON usage (key_id)",
    )


def m002_scheduler(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE bus_peers (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            kind VARCHAR(16) NOT NULL,
            public_key VARCHAR(40) NOT NULL,
            created_at {DOUBLE} NOT NULL)""",
        "CREATE UNIQUE INDEX buspeer_public_key ON bus_peers (public_key)",
        """CREATE TABLE cluster_secrets (
            name VARCHAR(100) NOT NULL PRIMARY KEY,
            value VARCHAR(200) NOT NULL,
            created_at {DOUBLE} NOT NULL)""",
        """CREATE TABLE measured_capacity (
            model VARCHAR(200) NOT NULL,
            profile VARCHAR(64) NOT NULL,
            memory_bytes {BIGINT} NOT NULL,
            samples INTEGER NOT NULL,
            updated_at {DOUBLE} NOT NULL,
            PRIMARY KEY (model, profile))""",
    )


def m003_parking(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE parked_models (
            model VARCHAR(200) NOT NULL PRIMARY KEY,
            profile VARCHAR(64) NOT NULL,
            reason TEXT NOT NULL,
            failures INTEGER NOT NULL,
            parked_at {DOUBLE} NOT NULL)""",
    )


def m004_drains(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE drained_nodes (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            since {DOUBLE} NOT NULL)""",
    )


def m005_runtime_models(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE runtime_models (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            definition TEXT NOT NULL,
            created_at {DOUBLE} NOT NULL)""",
        """CREATE TABLE model_scale (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            min INTEGER NOT NULL,
            max INTEGER NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
    )


def m006_audit_log(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE audit_log (
            id {BIGAUTO},
            at {DOUBLE} NOT NULL,
            actor VARCHAR(200) NOT NULL,
            client VARCHAR(100) NOT NULL,
            action VARCHAR(64) NOT NULL,
            target VARCHAR(300) NOT NULL,
            detail TEXT NOT NULL)""",
        "CREATE INDEX auditentry_at ON audit_log (at)",
    )


def m007_tenancy(db: peewee.Database) -> None:
    """Orgs, teams, projects and users; limits and budgets and the routers' counters;
    who each key and usage row belongs to; daily usage rollups."""
    run(
        db,
        """CREATE TABLE orgs (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            created_at {DOUBLE} NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
        "CREATE INDEX org_updated_at ON orgs (updated_at)",
        """CREATE TABLE teams (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            org VARCHAR(200) NOT NULL,
            created_at {DOUBLE} NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
        "CREATE INDEX team_org ON teams (org)",
        "CREATE INDEX team_updated_at ON teams (updated_at)",
        """CREATE TABLE projects (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            org VARCHAR(200) NOT NULL,
            team VARCHAR(200),
            band VARCHAR(32) NOT NULL,
            created_at {DOUBLE} NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
        "CREATE INDEX project_org ON projects (org)",
        "CREATE INDEX project_updated_at ON projects (updated_at)",
        """CREATE TABLE users (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            org VARCHAR(200) NOT NULL,
            team VARCHAR(200),
            created_at {DOUBLE} NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
        "CREATE INDEX user_org ON users (org)",
        "CREATE INDEX user_updated_at ON users (updated_at)",
        """CREATE TABLE limits (
            scope VARCHAR(16) NOT NULL,
            subject VARCHAR(200) NOT NULL,
            rpm {BIGINT},
            tpm {BIGINT},
            concurrent INTEGER,
            updated_at {DOUBLE} NOT NULL,
            PRIMARY KEY (scope, subject))""",
        "CREATE INDEX limit_updated_at ON limits (updated_at)",
        """CREATE TABLE budgets (
            scope VARCHAR(16) NOT NULL,
            subject VARCHAR(200) NOT NULL,
            period VARCHAR(8) NOT NULL,
            tokens {BIGINT},
            cost {DOUBLE},
            updated_at {DOUBLE} NOT NULL,
            PRIMARY KEY (scope, subject, period))""",
        "CREATE INDEX budget_updated_at ON budgets (updated_at)",
        """CREATE TABLE limit_windows (
            counter VARCHAR(300) NOT NULL,
            "window" {BIGINT} NOT NULL,
            leased {BIGINT} NOT NULL,
            granted {BIGINT} NOT NULL,
            ends_at {DOUBLE} NOT NULL,
            PRIMARY KEY (counter, "window"))""",
        "CREATE INDEX limitwindow_ends_at ON limit_windows (ends_at)",
        """CREATE TABLE concurrency_holds (
            counter VARCHAR(300) NOT NULL,
            holder VARCHAR(100) NOT NULL,
            slots INTEGER NOT NULL,
            expires_at {DOUBLE} NOT NULL,
            PRIMARY KEY (counter, holder))""",
        """CREATE TABLE usage_daily (
            id {BIGAUTO},
            day {DOUBLE} NOT NULL,
            key_id VARCHAR(32),
            "user" VARCHAR(200),
            project VARCHAR(200),
            team VARCHAR(200),
            org VARCHAR(200),
            model VARCHAR(200) NOT NULL,
            served_model VARCHAR(200),
            requests {BIGINT} NOT NULL,
            errors {BIGINT} NOT NULL,
            prompt_tokens {BIGINT} NOT NULL,
            completion_tokens {BIGINT} NOT NULL,
            cost {DOUBLE})""",
        "CREATE INDEX usagedaily_day ON usage_daily (day)",
        """CREATE TABLE usage_days (
            day {DOUBLE} NOT NULL PRIMARY KEY,
            rolled_at {DOUBLE} NOT NULL,
            "rows" {BIGINT} NOT NULL,
            pruned {BOOL} NOT NULL)""",
        # Attribution on each usage row, as the key's tenancy was when the request came.
        'ALTER TABLE usage ADD COLUMN "user" VARCHAR(200)',
        "ALTER TABLE usage ADD COLUMN project VARCHAR(200)",
        "ALTER TABLE usage ADD COLUMN team VARCHAR(200)",
        "ALTER TABLE usage ADD COLUMN org VARCHAR(200)",
        "ALTER TABLE usage ADD COLUMN cost {DOUBLE}",
    )
    # Keys gain a user, a project and a band; existing keys get no user and band "".
    # band ends NOT NULL with no default in the schema (the model supplies ""), as it
    # was before this rewrite: PostgreSQL fills existing rows through a default, then
    # drops it.
    if is_postgres(db):
        run(
            db,
            'ALTER TABLE api_keys ADD COLUMN "user" VARCHAR(200)',
            "ALTER TABLE api_keys ADD COLUMN project VARCHAR(200)",
            "ALTER TABLE api_keys ADD COLUMN band VARCHAR(32) NOT NULL DEFAULT ''",
            "ALTER TABLE api_keys ALTER COLUMN band DROP DEFAULT",
        )
        return
    # SQLite cannot add a NOT NULL column without a default, nor drop a default: the
    # table is rebuilt (https://www.sqlite.org/lang_altertable.html#otheralter).
    run(
        db,
        """CREATE TABLE api_keys_m007 (
            id VARCHAR(32) NOT NULL PRIMARY KEY,
            name VARCHAR(200) NOT NULL,
            secret_hash VARCHAR(64) NOT NULL,
            prefix VARCHAR(32) NOT NULL,
            models TEXT NOT NULL,
            created_at {DOUBLE} NOT NULL,
            expires_at {DOUBLE},
            revoked_at {DOUBLE},
            updated_at {DOUBLE} NOT NULL,
            "user" VARCHAR(200),
            project VARCHAR(200),
            band VARCHAR(32) NOT NULL)""",
        """INSERT INTO api_keys_m007
            SELECT id, name, secret_hash, prefix, models, created_at, expires_at,
                   revoked_at, updated_at, NULL, NULL, '' FROM api_keys""",
        "DROP TABLE api_keys",
        "ALTER TABLE api_keys_m007 RENAME TO api_keys",
        "CREATE UNIQUE INDEX apikey_secret_hash ON api_keys (secret_hash)",
        "CREATE INDEX apikey_updated_at ON api_keys (updated_at)",
    )


def m008_leadership(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE leader_lease (
            id INTEGER NOT NULL PRIMARY KEY,
            holder VARCHAR(300) NOT NULL,
            name VARCHAR(200) NOT NULL,
            admin_url VARCHAR(300) NOT NULL,
            epoch {BIGINT} NOT NULL,
            acquired_at {DOUBLE} NOT NULL,
            expires_at {DOUBLE} NOT NULL)""",
        """CREATE TABLE schedulers (
            name VARCHAR(200) NOT NULL PRIMARY KEY,
            holder VARCHAR(300) NOT NULL,
            role VARCHAR(16) NOT NULL,
            admin_url VARCHAR(300) NOT NULL,
            seen_at {DOUBLE} NOT NULL)""",
        """CREATE TABLE replica_intents (
            id VARCHAR(64) NOT NULL PRIMARY KEY,
            model VARCHAR(200) NOT NULL,
            node VARCHAR(200) NOT NULL,
            profile VARCHAR(64) NOT NULL,
            epoch {BIGINT} NOT NULL,
            created_at {DOUBLE} NOT NULL)""",
    )


def m009_operators(db: peewee.Database) -> None:
    run(
        db,
        """CREATE TABLE operators (
            name VARCHAR(100) NOT NULL PRIMARY KEY,
            role VARCHAR(16) NOT NULL,
            token_hash VARCHAR(64) NOT NULL,
            created_at {DOUBLE} NOT NULL)""",
        "CREATE UNIQUE INDEX operators_token_hash ON operators (token_hash)",
    )


def m010_usage_row_id(db: peewee.Database) -> None:
    """usage.row_id, unique: each row's own id, so replaying a router's usage spool
    after a crash inserts every row once."""
    run(
        db,
        "ALTER TABLE usage ADD COLUMN row_id VARCHAR(32)",
        "CREATE UNIQUE INDEX usage_row_id ON usage (row_id)",
    )


def m011_mirrored_weights(db: peewee.Database) -> None:
    """The control plane's weights mirror: per model, where its weights came from and
    the content they were pinned to (the files are blobs named by their sha256)."""
    run(
        db,
        """CREATE TABLE mirrored_weights (
            model VARCHAR(200) NOT NULL PRIMARY KEY,
            source VARCHAR(1000) NOT NULL,
            sha256 VARCHAR(64) NOT NULL,
            files TEXT NOT NULL,
            size {BIGINT} NOT NULL,
            pinned_at {DOUBLE} NOT NULL,
            pulled_at {DOUBLE} NOT NULL)""",
    )


def m012_join_tokens(db: peewee.Database) -> None:
    """One-time tokens a new node joins with (`llmgw nodes join-token`): only their
    SHA-256 is kept, with the node they are for, their expiry and their use."""
    run(
        db,
        """CREATE TABLE join_tokens (
            token_hash VARCHAR(64) NOT NULL PRIMARY KEY,
            node VARCHAR(100) NOT NULL,
            created_at {DOUBLE} NOT NULL,
            expires_at {DOUBLE} NOT NULL,
            used_at {DOUBLE},
            used_from VARCHAR(100))""",
    )


def m013_node_access(db: peewee.Database) -> None:
    """How `llmgw nodes onboard` reached each node (ssh target, key file, options) and
    where it installed llmgw there, so `llmgw nodes upgrade` can do it again."""
    run(
        db,
        """CREATE TABLE node_access (
            node VARCHAR(100) NOT NULL PRIMARY KEY,
            access TEXT NOT NULL,
            updated_at {DOUBLE} NOT NULL)""",
    )


def m014_usage_api(db: peewee.Database) -> None:
    """usage.api: the API path a request came by (/v1/chat/completions, /v1/messages,
    /v1/responses…), now that the router speaks more than OpenAI's. NULL on older rows."""
    run(db, "ALTER TABLE usage ADD COLUMN api VARCHAR(64)")


def m015_responses(db: peewee.Database) -> None:
    """responses: the Responses API's state, kept by the routers (engines are stateless):
    each stored response's own input, the conversation before it, and the answer."""
    run(
        db,
        """CREATE TABLE responses (
            id VARCHAR(100) NOT NULL PRIMARY KEY,
            key_id VARCHAR(32) NOT NULL,
            created_at {DOUBLE} NOT NULL,
            model VARCHAR(200) NOT NULL,
            previous_id VARCHAR(100),
            input TEXT NOT NULL,
            context TEXT NOT NULL,
            body TEXT NOT NULL)""",
        "CREATE INDEX storedresponse_created_at ON responses (created_at)",
    )


def m016_responses_chain(db: peewee.Database) -> None:
    """responses as a chain: each row keeps its own turn (its input and the answer) and
    the id of the response it continues, no longer a copy of the whole conversation
    before it, which grew with the square of a conversation's length. A row whose
    previous response is stored drops its copy (walking the chain back rebuilds it). A
    row whose previous one is gone (deleted, pruned) keeps its copy and ends its chain:
    previous_id NULL (its body still says previous_response_id), so it can still be
    continued as before. The index finds the responses that continue one, for pruning."""
    run(
        db,
        "CREATE INDEX storedresponse_previous_id ON responses (previous_id)",
        "UPDATE responses SET context = '[]' WHERE previous_id IN (SELECT id FROM responses)",
        """UPDATE responses SET previous_id = NULL
            WHERE previous_id IS NOT NULL AND previous_id NOT IN (SELECT id FROM responses)""",
    )


def m017_usage_cached(db: peewee.Database) -> None:
    """usage.cached_tokens: of a request's prompt tokens, those its engine said it reused
    from its cache (NULL: it did not say), so the usage rows can be checked against the
    engines' own counters (`llmgw usage reconcile`); and an index on (endpoint, at), the
    check's query for one replica over a window."""
    run(
        db,
        "ALTER TABLE usage ADD COLUMN cached_tokens INTEGER",
        "CREATE INDEX usage_endpoint_at ON usage (endpoint, at)",
    )


def m018_mirrored_revision(db: peewee.Database) -> None:
    """mirrored_weights.revision: the commit an hf:// source resolved to at its first
    pull, which later pulls must resolve to again (NULL for every other source)."""
    run(db, "ALTER TABLE mirrored_weights ADD COLUMN revision VARCHAR(40)")


def m019_replica_intent_gpus(db: peewee.Database) -> None:
    """replica_intents.gpus: the UUIDs of the GPUs a replica was assigned, comma-joined,
    so a leader that takes over keeps them booked while the agent loads it."""
    run(db, "ALTER TABLE replica_intents ADD COLUMN gpus TEXT NOT NULL DEFAULT ''")


def m020_replica_intent_profile(db: peewee.Database) -> None:
    """replica_intents.profile_name: the name of the model's profile a replica was started
    with ([[models.profiles]]), so a leader that takes over knows which it runs."""
    run(db, "ALTER TABLE replica_intents ADD COLUMN profile_name VARCHAR(64) NOT NULL DEFAULT ''")


def m021_replication(db: peewee.Database) -> None:
    """Replication between schedulers: the published releases (until now only files in
    the leader's release directory, which a new leader on another disk did not have),
    and how far each scheduler's copy of the mirror and the releases is behind (NULL:
    not reported, by a scheduler from before this migration)."""
    run(
        db,
        """CREATE TABLE published_releases (
            filename VARCHAR(300) NOT NULL PRIMARY KEY,
            version VARCHAR(100) NOT NULL,
            sha256 VARCHAR(64) NOT NULL,
            size {BIGINT} NOT NULL,
            published_at {DOUBLE} NOT NULL)""",
    )
    run(db, "ALTER TABLE schedulers ADD COLUMN missing_blobs INTEGER")
    run(db, "ALTER TABLE schedulers ADD COLUMN missing_bytes {BIGINT}")


MIGRATIONS = [
    m001_initial,
    m002_scheduler,
    m003_parking,
    m004_drains,
    m005_runtime_models,
    m006_audit_log,
    m007_tenancy,
    m008_leadership,
    m009_operators,
    m010_usage_row_id,
    m011_mirrored_weights,
    m012_join_tokens,
    m013_node_access,
    m014_usage_api,
    m015_responses,
    m016_responses_chain,
    m017_usage_cached,
    m018_mirrored_revision,
    m019_replica_intent_gpus,
    m020_replica_intent_profile,
    m021_replication,
]


def _applied(db: peewee.Database) -> set[str]:
    run(
        db,
        """CREATE TABLE IF NOT EXISTS llmgw_migrations (
            name VARCHAR(255) NOT NULL PRIMARY KEY,
            applied_at {DOUBLE} NOT NULL)""",
    )
    return {name for (name,) in db.execute_sql("SELECT name FROM llmgw_migrations")}


def pending(db: peewee.Database) -> list[str]:
    done = _applied(db)
    return [f.__name__ for f in MIGRATIONS if f.__name__ not in done]


def migrate(db: peewee.Database) -> list[str]:
    """Apply every pending migration; return the names applied."""
    done = _applied(db)
    applied = []
    record = f"INSERT INTO llmgw_migrations (name, applied_at) VALUES ({db.param}, {db.param})"
    todo = [step for step in MIGRATIONS if step.__name__ not in done]
    if not todo:
        return applied
    # A migration over a large table may take minutes: no store timeout applies to it.
    with patient(db):
        for step in todo:
            with db.atomic():
                step(db)
                db.execute_sql(record, (step.__name__, time.time()))
            applied.append(step.__name__)
    return applied
