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

    class Meta:
        table_name = "usage"


ALL_MODELS = [Migration, ApiKey, Usage]
