"""Tables of the store. Times are Unix seconds (float): portable and easy to compare."""

import peewee

db_proxy = peewee.DatabaseProxy()


class BaseModel(peewee.Model):
    class Meta:
        database = db_proxy


class Migration(BaseModel):
    """A migration that has been applied, by name."""

    name = peewee.CharField(primary_key=True)
    applied_at = peewee.DoubleField()

    class Meta:
        table_name = "llmgw_migrations"


class ApiKey(BaseModel):
    """An API key. Only the SHA-256 of the secret is kept; the secret is shown once."""

    id = peewee.CharField(primary_key=True, max_length=32)
    name = peewee.CharField(max_length=200)
    secret_hash = peewee.CharField(max_length=64, unique=True)
    prefix = peewee.CharField(max_length=32)
    models = peewee.TextField(default="")  # comma-separated; empty means every model
    created_at = peewee.DoubleField()
    expires_at = peewee.DoubleField(null=True)
    revoked_at = peewee.DoubleField(null=True)
    # Bumped on every change, so routers can pick up changes incrementally.
    updated_at = peewee.DoubleField(index=True)
    # Tenancy (m007): the user it belongs to, the project it works for, its priority
    # band ("" : the project's band, else the router's default). Keys made before m007
    # have no user.
    user = peewee.CharField(max_length=200, null=True)
    project = peewee.CharField(max_length=200, null=True)
    band = peewee.CharField(max_length=32, default="")

    class Meta:
        table_name = "api_keys"

    @property
    def model_list(self) -> list[str]:
        return [m for m in self.models.split(",") if m]


class Usage(BaseModel):
    """One request the router answered (or gave up on)."""

    id = peewee.BigAutoField()
    at = peewee.DoubleField(index=True)
    request_id = peewee.CharField(max_length=64)
    key_id = peewee.CharField(max_length=32, null=True, index=True)
    model = peewee.CharField(max_length=200)
    served_model = peewee.CharField(max_length=200, null=True)
    endpoint = peewee.CharField(max_length=200, null=True)
    prompt_tokens = peewee.IntegerField(default=0)
    completion_tokens = peewee.IntegerField(default=0)
    status = peewee.IntegerField()
    latency_ms = peewee.DoubleField()
    ttft_ms = peewee.DoubleField(null=True)
    # Attribution (m007), as the key's tenancy was when the request came, and its cost
    # at the served model's prices (None: the model has no prices).
    user = peewee.CharField(max_length=200, null=True)
    project = peewee.CharField(max_length=200, null=True)
    team = peewee.CharField(max_length=200, null=True)
    org = peewee.CharField(max_length=200, null=True)
    cost = peewee.DoubleField(null=True)
    # The router's own id for the row (m010), unique: a router replaying its usage spool
    # after a crash inserts each row once. Not request_id: a client may send its own
    # x-request-id, twice. NULL on rows written before m010.
    row_id = peewee.CharField(max_length=32, null=True, unique=True)
    # The API path the request came by (m014); NULL on rows written before it.
    api = peewee.CharField(max_length=64, null=True)
    # Of prompt_tokens, those the engine said it reused from its cache (m017); NULL where
    # it did not say, and on rows written before m017.
    cached_tokens = peewee.IntegerField(null=True)

    class Meta:
        table_name = "usage"
        indexes = ((("endpoint", "at"), False),)


class BusPeer(BaseModel):
    """An agent or router allowed on the bus, by the public half of its CURVE keypair."""

    name = peewee.CharField(primary_key=True, max_length=200)
    kind = peewee.CharField(max_length=16)  # agent | router
    public_key = peewee.CharField(max_length=40, unique=True)
    created_at = peewee.DoubleField()

    class Meta:
        table_name = "bus_peers"


class ClusterSecret(BaseModel):
    """Secrets the whole cluster shares, e.g. the one engine keys are derived from."""

    name = peewee.CharField(primary_key=True, max_length=100)
    value = peewee.CharField(max_length=200)
    created_at = peewee.DoubleField()

    class Meta:
        table_name = "cluster_secrets"


class MeasuredCapacity(BaseModel):
    """What replicas of a model and profile really used, to correct the GGUF estimate."""

    model = peewee.CharField(max_length=200)
    profile = peewee.CharField(max_length=64)  # a hash of what changes memory use
    memory_bytes = peewee.BigIntegerField()
    samples = peewee.IntegerField(default=1)
    updated_at = peewee.DoubleField()

    class Meta:
        table_name = "measured_capacity"
        primary_key = peewee.CompositeKey("model", "profile")


class ParkedModel(BaseModel):
    """A model that failed to start too often: not placed again until its definition
    changes (another profile) or an operator says `llmgw retry`."""

    model = peewee.CharField(primary_key=True, max_length=200)
    profile = peewee.CharField(max_length=64)
    reason = peewee.TextField()
    failures = peewee.IntegerField()
    parked_at = peewee.DoubleField()

    class Meta:
        table_name = "parked_models"


class DrainedNode(BaseModel):
    """A node being emptied (`llmgw drain`): nothing new is placed there."""

    name = peewee.CharField(primary_key=True, max_length=200)
    since = peewee.DoubleField()

    class Meta:
        table_name = "drained_nodes"


class RuntimeModel(BaseModel):
    """A model added with `llmgw models add`: its [[models]] table as JSON."""

    name = peewee.CharField(primary_key=True, max_length=200)
    definition = peewee.TextField()
    created_at = peewee.DoubleField()

    class Meta:
        table_name = "runtime_models"


class ModelScale(BaseModel):
    """`llmgw scale`: min and max replicas that override the model's definition."""

    name = peewee.CharField(primary_key=True, max_length=200)
    min = peewee.IntegerField()
    max = peewee.IntegerField()
    updated_at = peewee.DoubleField()

    class Meta:
        table_name = "model_scale"


class AuditEntry(BaseModel):
    """One change made through the admin API (or `--store`): who, what, when."""

    id = peewee.BigAutoField()
    at = peewee.DoubleField(index=True)
    actor = peewee.CharField(max_length=200)  # as the client says: user@host
    client = peewee.CharField(max_length=100)  # the address it came from, or "local"
    action = peewee.CharField(max_length=64)  # e.g. keys.create, restart, drain
    target = peewee.CharField(max_length=300, default="")  # what it acted on
    detail = peewee.TextField(default="{}")  # JSON: the change's parameters, no secrets

    class Meta:
        table_name = "audit_log"


class Lease(BaseModel):
    """The leader lease: one row. `epoch` rises by one on every takeover, never resets."""

    id = peewee.IntegerField(primary_key=True)  # always 1
    holder = peewee.CharField(max_length=300)  # name/host/pid/nonce of the leading process
    name = peewee.CharField(max_length=200)
    admin_url = peewee.CharField(max_length=300, default="")
    epoch = peewee.BigIntegerField()
    acquired_at = peewee.DoubleField()  # the database's clock, Unix seconds
    expires_at = peewee.DoubleField()

    class Meta:
        table_name = "leader_lease"


class SchedulerSeen(BaseModel):
    """Each scheduler, as it last said it was (leader or standby), for `llmgw status`."""

    name = peewee.CharField(primary_key=True, max_length=200)
    holder = peewee.CharField(max_length=300)
    role = peewee.CharField(max_length=16)
    admin_url = peewee.CharField(max_length=300, default="")
    seen_at = peewee.DoubleField()  # the database's clock
    # What its replication worker last counted as missing from its own copy of the
    # mirror and the releases (m021); NULL: never said.
    missing_blobs = peewee.IntegerField(null=True)
    missing_bytes = peewee.BigIntegerField(null=True)

    class Meta:
        table_name = "schedulers"


class ReplicaIntent(BaseModel):
    """A replica the leader is about to start, written before the command is sent, so a
    new leader knows what may be on its way to an agent and does not start it twice."""

    id = peewee.CharField(primary_key=True, max_length=64)
    model = peewee.CharField(max_length=200)
    node = peewee.CharField(max_length=200)
    profile = peewee.CharField(max_length=64)
    epoch = peewee.BigIntegerField()
    created_at = peewee.DoubleField()
    gpus = peewee.TextField(default="")  # the UUIDs of its GPUs, comma-joined (m019)
    # The name of the model's profile it runs (m020; "": from before profiles had names).
    profile_name = peewee.CharField(max_length=64, default="")

    class Meta:
        table_name = "replica_intents"


class Operator(BaseModel):
    """A person's (or a script's) admin API token, with a role (m009). Only the SHA-256
    of the token is kept; the token is shown once."""

    name = peewee.CharField(primary_key=True, max_length=100)
    role = peewee.CharField(max_length=16)  # "read" or "admin"
    token_hash = peewee.CharField(max_length=64, unique=True)
    created_at = peewee.DoubleField()

    class Meta:
        table_name = "operators"


class MirroredWeights(BaseModel):
    """A model's weights in the control plane's mirror (m011). `files` is the manifest,
    a JSON list of {"name", "sha256", "size"} (one entry for one GGUF; several for split
    GGUFs or a directory); `sha256` is the single file's, or the manifest's for several.
    A source with no sha256 in the catalog is pinned to this at its first pull; an hf://
    source also to `revision`, the commit it resolved to then (m018)."""

    model = peewee.CharField(primary_key=True, max_length=200)
    source = peewee.CharField(max_length=1000)
    sha256 = peewee.CharField(max_length=64)
    files = peewee.TextField()
    size = peewee.BigIntegerField()
    pinned_at = peewee.DoubleField()
    pulled_at = peewee.DoubleField()
    revision = peewee.CharField(max_length=40, null=True)

    class Meta:
        table_name = "mirrored_weights"


class PublishedRelease(BaseModel):
    """A wheel published with `llmgw release publish` (m021): what every scheduler's
    release directory must hold, so a new leader on its own disk still serves it."""

    filename = peewee.CharField(primary_key=True, max_length=300)
    version = peewee.CharField(max_length=100)
    sha256 = peewee.CharField(max_length=64)
    size = peewee.BigIntegerField()
    published_at = peewee.DoubleField()

    class Meta:
        table_name = "published_releases"


class JoinToken(BaseModel):
    """A one-time token for node NAME to join with (m012); only its SHA-256 is kept."""

    token_hash = peewee.CharField(primary_key=True, max_length=64)
    node = peewee.CharField(max_length=100)
    created_at = peewee.DoubleField()
    expires_at = peewee.DoubleField()
    used_at = peewee.DoubleField(null=True)
    used_from = peewee.CharField(max_length=100, null=True)  # the address it came from

    class Meta:
        table_name = "join_tokens"


class NodeAccess(BaseModel):
    """How a node was onboarded (m013): JSON of the ssh target, identity file, ssh
    options, venv, config, state directory and Python, for `llmgw nodes upgrade`."""

    node = peewee.CharField(primary_key=True, max_length=100)
    access = peewee.TextField()
    updated_at = peewee.DoubleField()

    class Meta:
        table_name = "node_access"


class StoredResponse(BaseModel):
    """A Responses API answer the router keeps (m015), for previous_response_id, GET and
    input_items; only the key that made it sees it. Since m016 a chain: each row holds
    its own turn and the id of the response it continues. Pruned with
    usage.retention_days, a whole conversation at a time."""

    id = peewee.CharField(max_length=100, primary_key=True)
    key_id = peewee.CharField(max_length=32)
    created_at = peewee.DoubleField(index=True)
    model = peewee.CharField(max_length=200)
    # The stored response this one continues; NULL for a conversation's first, and for
    # one stored before m016 whose previous was already gone (`context` holds it).
    previous_id = peewee.CharField(max_length=100, null=True, index=True)
    input = peewee.TextField()  # this request's own input items (JSON)
    context = peewee.TextField()  # the conversation before it that no row holds (JSON)
    body = peewee.TextField()  # the response object as answered (JSON)

    class Meta:
        table_name = "responses"


ALL_MODELS = [
    Migration,
    ApiKey,
    Usage,
    BusPeer,
    ClusterSecret,
    MeasuredCapacity,
    ParkedModel,
    DrainedNode,
    RuntimeModel,
    ModelScale,
    AuditEntry,
    Lease,
    SchedulerSeen,
    ReplicaIntent,
    MirroredWeights,
    PublishedRelease,
    JoinToken,
    NodeAccess,
    StoredResponse,
]
