"""The one configuration file: /etc/llmgw/llmgw.toml, with a section per tool.

Every key has a default that works on one machine, so an empty file (or none at all,
when the default path does not exist) is a valid configuration. An unknown key is an
error that names the key and the file: a typo must never be silently ignored. A
secret is never inline: `key = "@/etc/llmgw/secrets/engine.key"` reads the file.
Relative paths, secret files included, are relative to the config file's directory.
"""

import dataclasses
import os
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.errors import ConfigError

DEFAULT_PATH = Path("/etc/llmgw/llmgw.toml")


def secret(default: str = "", doc: str = ""):
    """A field whose value, if it starts with '@', is read from that file. Never in a repr,
    so a config printed or logged for debugging does not carry it."""
    return field(default=default, repr=False, metadata={"secret": True, "doc": doc})


@dataclass
class LogConfig:
    level: str = "info"


@dataclass
class PathsConfig:
    config_dir: str = "/etc/llmgw"
    state_dir: str = "/var/lib/llmgw"
    backup_dir: str = "/var/backups/llmgw"


@dataclass
class StoreConfig:
    # Empty means SQLite under paths.state_dir; LLMGW_STORE overrides either.
    url: str = ""
    # PostgreSQL: the longest a tool waits to connect, and the scheduler and router for
    # any answer (store/timeouts.py); a scheduler uses step_down_s - renew_s if less.
    timeout_s: float = 10.0


@dataclass
class EndpointConfig:
    id: str = ""
    url: str = ""
    models: list[str] = field(default_factory=list)
    key: str = secret()


@dataclass
class RouterConfig:
    listen: str = "127.0.0.1:8080"
    max_body_bytes: int = 4 * 1024 * 1024
    keepalive_interval_s: float = 5.0
    connect_timeout_s: float = 3.0
    upstream_timeout_s: float = 600.0
    dead_engine_s: float = 10.0
    retries: int = 2
    cooldown_s: float = 5.0
    key_refresh_s: float = 2.0
    usage_flush_s: float = 1.0
    usage_batch: int = 500
    usage_buffer: int = 100_000
    # The usage writer's thread runs at this nice value (0-19), so that on a busy core
    # requests come first; the spool holds what it has not written yet.
    usage_writer_nice: int = 10
    # Each usage row goes to a spool file on local disk before the store, so a crashed
    # router loses none; the directory is this router's alone (empty: the usage-spool
    # directory in paths.state_dir). false: rows wait in memory only.
    usage_spool: bool = True
    usage_spool_dir: str = ""
    shutdown_grace_s: float = 30.0
    # What serves HTTP: "http1" (the router's own server, http1.py) or "aiohttp" (the
    # server before it, kept as a fallback).
    transport: str = "http1"
    # Requests' size and pace (http1 transport): a longer request line is answered 414,
    # a larger head 431; a head not complete header_timeout_s after it began, or a body
    # body_timeout_s after its head, 408; an idle connection closes after idle_timeout_s.
    max_url_bytes: int = 8192
    max_header_bytes: int = 16384
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 75.0
    # Connections to one engine at most; past it a request waits for one to come free.
    max_engine_connections: int = 1024
    endpoints: list[EndpointConfig] = field(default_factory=list)
    # The schedulers' routing-table feeds (PUB sockets); empty: static endpoints only.
    schedulers: list[str] = field(default_factory=list)
    # The schedulers' bus sockets, where this router asks for on-demand models and says
    # which models are in use (empty: it never asks).
    scheduler_bus: list[str] = field(default_factory=list)
    # This router's name on the bus: its CURVE keypair is <config_dir>/pki/curve/NAME.key.
    bus_name: str = "router"
    # How long a request for a model that is not up yet waits for it (then 503).
    activation_window_s: float = 60.0
    # Serve HTTPS with this certificate and key (e.g. from `llmgw-certmon issue`).
    tls_cert: str = ""
    tls_key: str = ""
    # Priority bands, highest first: while a model's replicas are saturated, waiting
    # requests are admitted band by band. A key's band, else its project's, else this.
    bands: list[str] = field(default_factory=lambda: ["gold", "silver", "bronze"])
    default_band: str = "silver"
    # How long a request may wait for a saturated model (then a fallback, or 503).
    queue_deadline_s: float = 30.0
    # Requests one replica serves at once, for models the router does not know from the
    # catalog ([[models]] profile.parallel); 0: never judge those saturated.
    slots_per_replica: int = 0
    # How often engines are asked how busy they are (llama-server's /slots, vLLM's
    # /metrics), so slots busy with other routers' requests count; 0: never.
    engine_probe_s: float = 1.0
    # How often tenancy, limits, budgets and the catalog's prices are re-read.
    limits_refresh_s: float = 2.0
    # How long a request may wait for the background thread to lease more allowance
    # from the store when this router's share of a limit has run out.
    lease_wait_s: float = 0.5
    # Tokens reserved for a request that sets no max_tokens while a token limit or
    # budget applies to it; it is then sent to the engine as its max_tokens.
    default_max_tokens: int = 4096
    # The Responses API: the most stored responses a continuation walks back through
    # (each keeps its own turn); a longer conversation is refused 400.
    responses_chain_max: int = 256
    # How a request's replica is chosen: "prefix" (where its prompt is most likely
    # cached, docs/architecture.md), "least-outstanding" or "round-robin".
    routing: str = "prefix"
    # prefix: weight of tokens already in flight on a replica against uncached tokens.
    prefix_alpha: float = 0.3
    # prefix: memory for every replica's remembered prompt blocks together.
    prefix_memory_mb: int = 64
    # prefix: the longest a request waits for another request on the same replica to
    # finish evaluating the prompt they share, rather than have it evaluated twice side
    # by side; 0: never wait.
    prefix_hold_s: float = 20.0
    # prefix, with more than one router: where this router tells the others what it
    # sent where and has in flight (a ZeroMQ endpoint, e.g. "tcp://0.0.0.0:7075"; CURVE
    # with its bus_name keypair; empty: nowhere), and where it hears them:
    # ["NAME@ENDPOINT"], each NAME a router registered with `llmgw routers add`.
    prefix_share: str = ""
    prefix_peers: list[str] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    bus: str = "tcp://127.0.0.1:7070"  # ROUTER socket agents connect to
    publish: str = "tcp://127.0.0.1:7071"  # PUB socket routers subscribe to
    metrics_listen: str = "127.0.0.1:9071"
    # The admin API `llmgw` talks to, and its bearer token (empty: made on first start
    # in <config_dir>/secrets/admin.token).
    admin_listen: str = "127.0.0.1:8081"
    admin_token: str = secret()
    # Serve the admin API over HTTPS with this certificate and key.
    admin_tls_cert: str = ""
    admin_tls_key: str = ""
    tick_s: float = 1.0
    node_lost_s: float = 10.0
    snapshot_s: float = 3.0
    # After a start, how long before an engine that is not ready counts as failed.
    start_timeout_s: float = 600.0
    # `llmgw drain`: a replica on a draining node is stopped once the model has enough
    # ready replicas elsewhere, or after this long regardless.
    drain_grace_s: float = 600.0
    # `llmgw restart`: a queued restart that waits this long while its model's restarts
    # do not move (none begins or ends) is given up, with the reason (0: never).
    restart_deadline_s: float = 3600.0
    # Eviction spares an on-demand model until its replicas have been ready this long
    # (0: no minimum), so two that cannot both fit do not evict each other in turn.
    eviction_min_lifetime_s: float = 300.0
    backoff_base_s: float = 2.0
    backoff_max_s: float = 300.0
    # After its own start, wait this long for agents to report before starting anything,
    # so replicas that are already running are not started twice.
    settle_s: float = 5.0
    # This scheduler's name among several sharing one PostgreSQL store (empty: the host
    # name), and the admin URL a standby names when it answers for the leader (empty:
    # http:// + admin_listen).
    name: str = ""
    admin_url: str = ""
    # The leader lease, kept in the store and timed by the database's clock: it lasts
    # lease_s, the leader renews it every renew_s and stops acting step_down_s after its
    # last renewal (before the lease can pass to another); a standby tries every
    # standby_retry_s. Need renew_s < step_down_s < lease_s.
    lease_s: float = 15.0
    renew_s: float = 5.0
    step_down_s: float = 10.0
    standby_retry_s: float = 2.0
    # Published llmgw wheels (`llmgw release publish`), which onboarding and upgrades
    # install on nodes; empty: <paths.state_dir>/releases.
    release_dir: str = ""
    # The weights mirror (`llmgw weights pull`): files by sha256, served to registered
    # nodes over the admin API; empty: <paths.state_dir>/mirror.
    mirror_dir: str = ""
    # A file holding the Hugging Face token that hf:// sources are pulled with, read at
    # each pull (a rotated token needs no restart) and never logged; empty: no token.
    hf_token_file: str = ""
    # Every scheduler keeps its own copy of the mirror and the releases, copied from a
    # peer scheduler: what the store names and this one lacks is looked for every
    # replicate_s; a copy that fails is tried again after replicate_s × 2^(failures
    # before it), at most replicate_backoff_max_s.
    replicate_s: float = 5.0
    replicate_backoff_max_s: float = 300.0


@dataclass
class OidcConfig:
    """Sign-on for operators with OpenID Connect (docs/operate.md, "Sign-on"); off while
    issuer is empty. Operators' tokens and the bootstrap token keep working beside it."""

    # The provider's issuer URL, exactly as its ID tokens' `iss` says it (https, or http
    # on loopback); its configuration is read from ISSUER/.well-known/openid-configuration.
    issuer: str = ""
    # The client the status page signs people in with (the code flow with PKCE); ID
    # tokens issued to it are taken as bearer tokens by the admin API too.
    client_id: str = ""
    client_secret: str = secret()
    # Where the provider sends the browser back: this scheduler's /oidc/callback, as
    # people's browsers reach it and as registered with the provider.
    redirect_url: str = ""
    # The public client (no secret) `llmgw login` uses for the device flow; ID tokens
    # issued to it are taken too. Empty: client_id.
    cli_client_id: str = ""
    # The ID token claim that gives a person a role (a dotted path reaches into an
    # object, e.g. "realm_access.roles"), and the values that give admin and read.
    role_claim: str = "groups"
    admin_values: list[str] = field(default_factory=lambda: ["llmgw-admins"])
    read_values: list[str] = field(default_factory=lambda: ["llmgw-readers"])
    scopes: list[str] = field(default_factory=lambda: ["openid", "email", "profile", "groups"])
    # How long the status page's session lasts after sign-in, whatever the ID token says.
    session_s: float = 8 * 3600.0


@dataclass
class EngineConfig:
    """An engine command the agent knows, beside the registered ones (llmgw/engines/)."""

    name: str = ""
    version: str = ""
    # argv template; {port} {host} {model_path} {key_file} {context} {parallel} fill in.
    command: list[str] = field(default_factory=list)
    health: str = "/health"


@dataclass
class AgentConfig:
    # The node's name on the bus: its CURVE keypair is <config_dir>/pki/curve/NAME.key.
    name: str = ""  # empty: the host name
    schedulers: list[str] = field(default_factory=lambda: ["tcp://127.0.0.1:7070"])
    host: str = "127.0.0.1"  # where engines listen, as routers reach them
    port_min: int = 8100
    port_max: int = 8199
    heartbeat_s: float = 2.0
    # A ready engine asked to stop first finishes what it is answering (routers have
    # stopped sending it anything), for at most this long; then SIGTERM.
    drain_timeout_s: float = 60.0
    metrics_listen: str = "127.0.0.1:9072"
    # Resources to report instead of what is detected (0 / -1: detect).
    cpus: int = 0
    memory_bytes: int = 0
    gpus: int = -1
    log_lines: int = 500
    # Weights this node keeps in <state_dir>/weights, at most (0: no bound). Past it the
    # least recently used are deleted, never those of a starting or running shard.
    weights_max_bytes: int = 0
    # Finished engine builds are looked for here before building (~/.cache/llmgw/engines).
    engine_cache: str = ""
    # A failed engine install is tried again after base × 2^(failures before it), at most
    # max, times 0.5-1.0; retries go on until one succeeds.
    install_backoff_base_s: float = 30.0
    install_backoff_max_s: float = 1800.0
    engines: list[EngineConfig] = field(default_factory=list)
    # The network between nodes of one replica (NCCL, `llmgw fabric test`): this
    # node's address and interface on it, and a label naming the fabric it is part of.
    fabric_address: str = ""
    fabric_interface: str = ""
    fabric: str = ""
    # The port range the agent's fabric test endpoint listens on (0/0: any free port).
    fabric_test_port_min: int = 0
    fabric_test_port_max: int = 0


@dataclass
class ProfileConfig:
    # [[models.profiles]] only: the profile's name, which each replica records.
    name: str = ""
    context: int = 4096
    parallel: int = 1
    gpus: int = 0
    args: list[str] = field(default_factory=list)
    # Memory one replica needs, when the GGUF estimate is unavailable or wrong (0: estimate).
    memory_bytes: int = 0
    # Nodes one replica spans (llama.cpp's RPC backend, docs/multinode.md): 1, 2-64, or
    # "auto" (split only when the model fits on no single node).
    nodes: int | str = 1
    # vLLM across nodes: GPUs per node (tensor) × nodes (pipeline); 0: not set.
    tensor_parallel: int = 0
    pipeline_parallel: int = 0
    # vLLM on CPU: GiB of KV cache it is given (VLLM_CPU_KVCACHE_SPACE); 0: 1 GiB.
    kv_cache_gib: int = 0
    # LoRA adapters (models with adapter_of = this one) each replica keeps loaded at
    # most, the least recently used unloaded first (vLLM: --max-loras); 0: none.
    max_adapters: int = 0


@dataclass
class ScalingConfig:
    min: int = 1
    max: int = 1
    # With min = 0: how long after its last request the model is stopped.
    keep_alive_s: float = 300.0
    # With min < max: autoscaling. One more replica after the model has been saturated
    # (every replica busy, or the routers' queue wait p90 over target) for up_after_s;
    # one fewer after utilisation (in flight / slots) stayed below down_below for
    # down_after_s; nothing changes for cooldown_s after a change.
    target_queue_wait_s: float = 5.0
    up_after_s: float = 30.0
    down_below: float = 0.3
    down_after_s: float = 300.0
    cooldown_s: float = 120.0


@dataclass
class CertmonConfig:
    # The CA and every issued certificate; empty: <paths.config_dir>/pki.
    dir: str = ""
    listen: str = "127.0.0.1:9073"  # the Prometheus scrape target of `llmgw-certmon serve`
    renew_before_days: int = 30
    validity_days: int = 90
    ca_validity_days: int = 3650


@dataclass
class BackupConfig:
    # Where `llmgw-backup run` writes archives; empty: paths.backup_dir.
    dir: str = ""
    keep: int = 14  # the newest archives kept; 0 keeps every one


@dataclass
class PricingConfig:
    # Price per million tokens, in whatever currency budgets are set in; 0: free.
    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


@dataclass
class UsageConfig:
    # `llmgw usage rollup` keeps raw usage rows this many days (0: forever); older
    # requests are kept as daily totals only.
    retention_days: int = 90
    # The usage rows checked against the engines' own token counters (the scheduler's
    # llmgw_usage_* gauges, UsageDisagreesWithEngines, `llmgw usage reconcile`): over the
    # last reconcile_window_s, ending reconcile_settle_s ago (requests under way then
    # have ended and been written), a replica whose rows and engine differ by more than
    # reconcile_threshold (a fraction of the engine's count) for 15 minutes alerts; a
    # replica with fewer than reconcile_min_tokens of a kind in the window is not judged.
    reconcile_window_s: float = 900.0
    reconcile_settle_s: float = 120.0
    reconcile_threshold: float = 0.01
    reconcile_min_tokens: int = 10000


@dataclass
class TracingConfig:
    # Where OpenTelemetry traces go: an OTLP/gRPC collector, e.g. "http://collector:4317"
    # ("https://" for TLS). Empty: no tracing at all, and nothing of it is made.
    endpoint: str = ""
    # The share of requests (admin requests, placement passes) traced, 0 to 1. A request
    # whose traceparent says its caller traced it is traced whatever this says.
    sample_rate: float = 0.1
    # The service.name spans carry; empty: the tool's own (llmgw-router, llmgw-scheduler).
    service_name: str = ""
    # Spans waiting for the exporter, at most: past it they are dropped and counted.
    queue_size: int = 2048


@dataclass
class ModelConfig:
    name: str = ""
    aliases: list[str] = field(default_factory=list)
    # A GGUF path, file:// or https:// URL (with sha256), or pypi:PACKAGE.
    source: str = ""
    sha256: str = ""
    engine: str = "llama.cpp"
    # Empty: the engine's own pinned version (llmgw/engines/: llama.cpp 0.3.36, vllm 0.32.0).
    engine_version: str = ""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # Named profiles, tried in order for each replica: the first that fits somewhere is
    # the one it runs (instead of `profile`; None: not given, `profile` is "default").
    profiles: list[ProfileConfig] | None = None
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    fallbacks: list[str] = field(default_factory=list)
    pricing: PricingConfig = field(default_factory=PricingConfig)
    # A LoRA adapter (its source a PEFT directory) served by the replicas of this model.
    adapter_of: str = ""


@dataclass
class Config:
    log: LogConfig = field(default_factory=LogConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    certmon: CertmonConfig = field(default_factory=CertmonConfig)
    backup: BackupConfig = field(default_factory=BackupConfig)
    usage: UsageConfig = field(default_factory=UsageConfig)
    oidc: OidcConfig = field(default_factory=OidcConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    models: list[ModelConfig] = field(default_factory=list)
    source: str = ""  # the file this came from, "" for built-in defaults

    def store_url(self) -> str:
        """The store's address: LLMGW_STORE, else store.url, else SQLite in state_dir."""
        url = os.environ.get("LLMGW_STORE") or self.store.url
        return url or f"sqlite://{Path(self.paths.state_dir).absolute()}/llmgw.db"

    def file(self, path: str) -> Path:
        """A file named in this config: relative paths are relative to the config file."""
        base = Path(self.source).absolute().parent if self.source else Path.cwd()
        return base / path

    def ca_file(self) -> Path:
        """The cluster CA's certificate, as llmgw-certmon keeps it."""
        return Path(self.paths.config_dir) / "pki" / "ca.crt"

    def backup_dir(self) -> Path:
        """Where archives go: backup.dir (relative to this file), else paths.backup_dir."""
        if self.backup.dir:
            base = Path(self.source).absolute().parent if self.source else Path.cwd()
            return base / self.backup.dir
        return Path(self.paths.backup_dir)

    def usage_spool_dir(self) -> Path:
        """The router's usage spool: router.usage_spool_dir (relative to this file), else
        usage-spool in paths.state_dir."""
        if self.router.usage_spool_dir:
            return self.file(self.router.usage_spool_dir)
        return Path(self.paths.state_dir).absolute() / "usage-spool"

    def release_dir(self) -> Path:
        """The control plane's releases: scheduler.release_dir (relative to this file),
        else releases in paths.state_dir."""
        if self.scheduler.release_dir:
            return self.file(self.scheduler.release_dir)
        return Path(self.paths.state_dir).absolute() / "releases"

    def mirror_dir(self) -> Path:
        """The weights mirror: scheduler.mirror_dir (relative to this file), else mirror
        in paths.state_dir."""
        if self.scheduler.mirror_dir:
            return self.file(self.scheduler.mirror_dir)
        return Path(self.paths.state_dir).absolute() / "mirror"

    def curve_dir(self) -> Path:
        return Path(self.paths.config_dir) / "pki" / "curve"


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _build(cls, data: dict, where: str, path: Path):
    """Build dataclass `cls` from a TOML table, naming the first bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: [{where}] must be a table")
    hints = {f.name: f for f in dataclasses.fields(cls)}
    if cls is Config:
        hints.pop("source")  # where the config came from: not a key of the file
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        f = hints.get(key)
        if f is None:
            raise ConfigError(f"{path}: unknown key '{name}'")
        kwargs[key] = _value(f, value, name, path)
    return cls(**kwargs)


def _value(f, value, name: str, path: Path):
    tp = f.type
    if isinstance(tp, types.UnionType) and type(None) in tp.__args__:
        # `X | None`: None is the default (not given), never a value in the file.
        (tp,) = (t for t in tp.__args__ if t is not type(None))
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name, path)
    origin = getattr(tp, "__origin__", None)
    if origin is list:
        (item,) = tp.__args__
        if not isinstance(value, list):
            raise ConfigError(f"{path}: '{name}' must be a list")
        if dataclasses.is_dataclass(item):
            return [_build(item, v, f"{name}[{i}]", path) for i, v in enumerate(value)]
        if not all(isinstance(v, item) for v in value):
            raise ConfigError(f"{path}: '{name}' must be a list of {_type_name(item)}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: '{name}' must be {_type_name(tp)}, not {type(value).__name__}")
    if f.metadata.get("secret") and isinstance(value, str) and value.startswith("@"):
        return read_secret(value, path.parent, name)
    return value


def model_from(data: dict, where: str = "model") -> ModelConfig:
    """One [[models]] table given some other way (the admin API): same keys, same checks."""
    return _build(ModelConfig, data, where, Path(where))


def read_secret(ref: str, base: Path, name: str = "secret") -> str:
    """Read `@/path/to/file` (relative to `base`), stripped of surrounding whitespace."""
    file = base / ref[1:]
    try:
        text = file.read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read {name} from {file}: {e.strerror}") from None
    if not text:
        raise ConfigError(f"{name}: {file} is empty")
    return text


def _resolve_paths(cfg: Config, base: Path) -> None:
    for f in dataclasses.fields(cfg.paths):
        setattr(cfg.paths, f.name, str(base / getattr(cfg.paths, f.name)))


def load(path: str | os.PathLike | None = None) -> Config:
    """Load the config from `path`, LLMGW_CONFIG, or /etc/llmgw/llmgw.toml.

    A path that was asked for must exist; the default path may be absent, and then
    every default applies.
    """
    asked = path or os.environ.get("LLMGW_CONFIG")
    file = Path(asked) if asked else DEFAULT_PATH
    if not file.exists():
        if asked:
            raise ConfigError(f"{file}: no such config file")
        return Config()
    try:
        data = tomllib.loads(file.read_text())
    except OSError as e:
        raise ConfigError(f"{file}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{file}: {e}") from None
    cfg = _build(Config, data, "", file)
    cfg.source = str(file)
    _resolve_paths(cfg, file.absolute().parent)
    return cfg


def example() -> str:
    """A fully commented sample config that loads as it is."""
    return (Path(__file__).parent / "example.toml").read_text()
