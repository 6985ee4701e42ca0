"""Engines: one module per engine, each filling in one `Engine` as data and small pure
functions, and the registry every tool asks.

An engine says how it is installed (`Install`), the command that starts it for a shard
(alone, the leader of a replica across nodes, or one of its workers), where its health
and its load signal are and how to read that signal (`Load`), how it drains (`Drain`),
which APIs it serves natively, its token counters (`TokenCounters`), whether it needs
GPUs and can span nodes, and which accelerators (CPU, CUDA) its builds can use — any
build (`Engine.accelerators`, for the catalog) and the one a node gets
(`Install.accelerators`, reported by the agent, for placement). The agent, the
scheduler, the router and the catalog ask this interface, never an engine's name: a
third engine is one new module here and one line in `BUILTIN`, or a `register()` call
(tests/third_engine.py).

An engine an agent adds with `[[agent.engines]]` (a command, no module) is not
registered: it is installed by nobody, needs no GPU, spans no node, is not known to be
able to use a GPU or not (nothing is refused for it), and its load signal
is looked for as every registered engine's in turn (`signal_sources`).
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# A shard's role: a replica on one node, or the leader or a worker of one across nodes.
ALONE, LEADER, WORKER = "alone", "leader", "worker"
# How an engine is installed: a build llmgw makes (and caches outside the state
# directory), a virtual environment pip fills, or nothing (the command is there already).
BUILD, VENV, PROVIDED = "build", "venv", "provided"
# The APIs an engine may serve itself, by the path the router would pass it.
CHAT, COMPLETIONS, EMBEDDINGS = "chat", "completions", "embeddings"
RESPONSES, MESSAGES, RERANK = "responses", "messages", "rerank"
# A worker with no HTTP of its own is ready when its port accepts connections (TCP), or,
# with no port of its own either, while its process runs (PROCESS): its gang is up when
# the leader's health answers, which needs every worker.
TCP, PROCESS = "tcp", "process"
# What an engine's build computes on: the CPU, or NVIDIA GPUs through CUDA. Only a build
# with a GPU accelerator can use the GPUs a profile asks for (profile.gpus).
CPU, CUDA = "cpu", "cuda"
GPU_ACCELERATORS = frozenset({CUDA})
# The engine modules shipped with llmgw, in the order their load signals are tried for
# an engine that is not registered (llama-server's /slots first, as before).
BUILTIN = ("llamacpp", "vllm")


@dataclass(frozen=True)
class Launch:
    """What a shard's command is made of, whatever the engine."""

    model_path: str
    host: str
    port: int
    key_file: str
    context: int
    parallel: int
    gpus: int = 0
    args: tuple[str, ...] = ()
    # The model's name in the catalog: engines answer with it as `model`, not the path.
    served_name: str = ""
    # A leader across nodes: its workers' HOST:PORT and each one's part (gangs.py).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    # The engine key itself, for an engine that takes it from the environment.
    key: str = field(default="", repr=False)
    threads: int = 0  # a worker's compute threads (0: every core)
    # GiB of KV cache an engine that is given a fixed space takes (vLLM on CPU); 0: its
    # engine's default.
    kv_cache_gib: int = 0
    # LoRA adapters it keeps loaded at most (profile.max_adapters); 0: it takes none.
    max_adapters: int = 0
    # profile.pipeline_parallel / tensor_parallel as set (0: the engine's choice).
    pipeline_parallel: int = 0
    tensor_parallel: int = 0
    # A shard of a gang whose workers join the leader (`Engine.joins_leader`): how many
    # nodes it spans, this shard's rank (0: the leader), the ADDR:PORT its ranks meet at
    # (the leader's fabric address and a port of its node), and this node's fabric
    # address and interface (agent.fabric_address / fabric_interface).
    nnodes: int = 1
    node_rank: int = 0
    master: str = ""
    fabric_address: str = ""
    fabric_interface: str = ""
    # Where an engine that traces sends its spans (OTLP/gRPC, `[tracing] endpoint` of the
    # node's config); "": it traces nothing.
    traces: str = ""


@dataclass(frozen=True)
class Command:
    """How to start one shard: its argv and what it adds to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Host:
    """What a node offers an install: whether it has GPUs, and the CUDA toolkit's
    compiler (its path; "": the toolkit is absent)."""

    gpus: bool = False
    nvcc: str = ""


def uses_gpus(accelerators) -> bool:
    """Whether a build that can use `accelerators` can use a GPU."""
    return not GPU_ACCELERATORS.isdisjoint(accelerators)


def built_for(accelerators) -> str:
    """`CPU only`, `CPU and CUDA`: what a build can use, as an operator reads it."""
    names = [a.upper() for a in sorted(accelerators)]
    if len(names) == 1:
        return f"{names[0]} only"
    return " and ".join([", ".join(names[:-1]), names[-1]]) if names else "nothing"


@dataclass(frozen=True)
class Install:
    """How one version of an engine comes to be on a node, as data the agent carries out."""

    method: str  # BUILD, VENV or PROVIDED
    requirements: tuple[str, ...] = ()  # pip requirements of a VENV
    # Files under the engine's directory (NAME-VERSION/) whose presence means installed;
    # written last, so a half-done install never counts.
    marks: tuple[str, ...] = ()
    note: str = ""  # what an operator reads about it
    # A VENV built once per machine in the engine cache under this name (outside every
    # state directory and clone, like the llama.cpp build) and linked as the engine's
    # directory; "": built in the engine's directory itself.
    cache: str = ""
    # Packages pip-uninstalled after the install (they break the import of others).
    remove: tuple[str, ...] = ()
    # What this install's build can use (CPU, CUDA): the agent reports it per engine, and
    # placement refuses a GPU profile on a node whose build cannot use a GPU.
    accelerators: tuple[str, ...] = (CPU,)


@dataclass(frozen=True)
class Load:
    """One reading of an engine's load signal."""

    running: int  # requests it is answering now (llama-server: busy slots)
    waiting: int = 0  # requests it queues itself
    slots: int = 0  # how many it answers at once, where it says (0: not said)
    ctx: int = 0  # tokens of context it caches over every slot (0: not said)
    kv_usage: float | None = None  # its KV cache's use, 0-1, where it says

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits: stopping it now cuts no request."""
        return self.running == 0 and self.waiting == 0


@dataclass(frozen=True)
class Drain:
    """How a ready engine stops without cutting requests: routers stop sending it new
    ones (the scheduler takes it out of the routing table, `settle_s` for them to apply
    that), then its load signal is read every `poll_s` until it is idle or the grace
    period (agent.drain_timeout_s) ends, and only then it gets SIGTERM."""

    settle_s: float = 1.0
    poll_s: float = 0.2


@dataclass(frozen=True)
class TokenCounters:
    """Its cumulative token counters in its Prometheus `/metrics`: the names summed into
    every prompt token it took (cached ones included), the one of those it reused from
    its cache, and the one of tokens it generated."""

    prompt: tuple[str, ...]
    generated: str
    cached: str = ""
    cached_required: bool = True  # False: an older version lacks it, and None is said


@dataclass(frozen=True)
class Adapters:
    """How a running engine loads and unloads a LoRA adapter (a PEFT directory on its
    node) by name: a POST of `load_body(name, path)` to `load_path`, of
    `unload_body(name)` to `unload_path`; a request then names the adapter as its model.
    An answer whose text holds `already` is taken as done (an agent that restarted
    loads again what its engine still has)."""

    load_path: str
    unload_path: str
    load_body: Callable[[str, str], dict]
    unload_body: Callable[[str], dict]
    already: tuple[str, ...] = ("already",)


@dataclass(frozen=True)
class Engine:
    name: str
    default_version: str  # what a model that names no engine_version gets
    install: Callable[[str, Host], Install]  # (version, what the node offers) -> Install
    # (role, the engine's directory NAME-VERSION/, launch) -> Command; EngineError for a
    # role it does not take.
    command: Callable[[str, Path, Launch], Command]
    load_path: str  # where its load signal is ("": it has none)
    read_load: Callable[[bytes], Load | None]  # one reader, for the agent and the router
    apis: frozenset[str]  # served natively; the router translates the others to chat
    counters: TokenCounters | None = None
    health: str = "/health"  # ready once it answers 200 here
    worker_health: str = TCP
    drain: Drain = Drain()
    needs_gpus: bool = False
    # What some build of it can use. With no GPU accelerator among them no model on it may
    # ask for GPUs (the catalog refuses it); one that can have a GPU build may still be
    # built for the CPU only on a node (its Install.accelerators), which placement refuses.
    accelerators: frozenset[str] = frozenset({CPU})
    spans_nodes: bool = False  # its replicas may be gangs (leader and workers)
    # Takes profile.tensor_parallel / pipeline_parallel.
    parallelism: bool = False
    # Asked at a stream's start to say the prompt's size (llama-server's
    # return_progress), so a stream cut short still bills its prompt.
    prompt_progress: bool = False
    worker_binary: str = ""  # a worker's program, relative to the engine's directory
    # Its workers load their own part of the weights and join a rendezvous the leader
    # opens (vLLM's --master-addr/--master-port): the leader starts first, with a port
    # for it, and its workers once it says where. False: the workers hold what the
    # leader sends them and listen for it (llama.cpp's rpc-server), so they start first.
    joins_leader: bool = False
    # (nodes, GPUs per node, profile.pipeline_parallel, tensor_parallel; 0: not set) ->
    # the (pipeline, tensor) sizes a replica runs with; ValueError saying what does not
    # fit. None: the engine takes no such sizes.
    layout: Callable[[int, int, int, int], tuple[int, int]] | None = None
    # The memory one replica needs, in bytes, from a Hugging Face model directory's
    # config.json (a dict) and its KV cache GiB (0: the default); None: the engine takes
    # no such directory (its estimate is the GGUF's, lib/llmgw/gguf.py).
    estimate_config: Callable[[dict, int], int] | None = None
    # LoRA adapters loaded and unloaded at runtime (models with adapter_of); None: the
    # engine takes none (profile.max_adapters and adapter_of are refused for it).
    adapters: Adapters | None = None

    def role_health(self, role: str) -> str:
        return self.worker_health if role == WORKER else self.health


_REGISTRY: dict[str, Engine] = {}


def register(engine: Engine) -> Engine:
    """Make `engine` known to every tool in this process (a new name, or a replacement)."""
    _REGISTRY[engine.name] = engine
    return engine


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Engine | None:
    """The registered engine called `name` (as a model's `engine`); None if there is none."""
    return _REGISTRY.get(name)


def of(engine_id: str) -> Engine | None:
    """The engine of an engine id as agents report them, NAME-VERSION."""
    return _REGISTRY.get(engine_id.rpartition("-")[0]) or _REGISTRY.get(engine_id)


def names() -> list[str]:
    return list(_REGISTRY)


def serves(name: str | None, api: str) -> bool:
    """Whether an engine serves `api` itself. One not registered is assumed to (its
    first refusal is remembered by the router and translated from then on)."""
    engine = _REGISTRY.get(name) if name else None
    return engine is None or api in engine.apis


def signal_sources(name: str | None) -> list[Engine]:
    """Whose load signal to read for an engine called `name`: its own, or for one not
    registered (an [[agent.engines]] command, or a name not said) every registered
    engine's in turn, the first that answers being it."""
    engine = _REGISTRY.get(name) if name else None
    if engine is not None:
        return [engine] if engine.load_path else []
    return [e for e in _REGISTRY.values() if e.load_path]


def read_load(engine: Engine, status: int, body: bytes) -> Load | None:
    """What one answer on `engine.load_path` says: None unless a 200 its reader takes."""
    if status != 200:
        return None
    try:
        return engine.read_load(body)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def prometheus(text: str, names) -> dict[str, float]:
    """Each of `names`' value in Prometheus text, summed over its label sets (a label
    value may hold a brace or a space)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if 0 <= brace < space or (brace >= 0 and space < 0):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name not in names:
            continue
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def read_tokens(engine: Engine, text: str) -> dict | None:
    """`{"prompt", "cached", "generated"}` from the engine's Prometheus text (cached None
    where it has no such counter); None where its counters are not all there."""
    c = engine.counters
    if c is None:
        return None
    wanted = {*c.prompt, c.generated, *((c.cached,) if c.cached else ())}
    got = prometheus(text, wanted)
    required = {*c.prompt, c.generated, *((c.cached,) if c.cached and c.cached_required else ())}
    if not required <= got.keys():
        return None
    cached = got.get(c.cached) if c.cached else None
    return {
        "prompt": round(sum(got[n] for n in c.prompt)),
        "cached": round(cached) if cached is not None else None,
        "generated": round(got[c.generated]),
    }


def _load_builtin() -> None:
    for module in BUILTIN:
        register(importlib.import_module(f"{__name__}.{module}").ENGINE)


_load_builtin()
