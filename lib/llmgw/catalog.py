"""The model catalog: `[[models]]` from the config, checked and turned into plain data.

A definition that cannot work is refused when the tool starts, naming the model and the
field, rather than failing later on some node at three in the morning.
"""

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass

from llmgw import engines, hub
from llmgw.config import ModelConfig, ProfileConfig, ScalingConfig
from llmgw.errors import ConfigError
from llmgw.gangs import AUTO, MAX_NODES
from llmgw.scaling import Settings

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PROFILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT = "default"  # the name of a model's one `profile`


@dataclass(frozen=True)
class Profile:
    """One way to run a replica of a model ([models.profile] or one of
    [[models.profiles]]), checked."""

    name: str
    context: int
    parallel: int
    gpus: int
    args: tuple[str, ...]
    memory_bytes: int
    nodes: int = 1
    kv_cache_gib: int = 0
    max_adapters: int = 0
    pipeline_parallel: int = 0
    tensor_parallel: int = 0

    def fields(self) -> dict:
        """Its fields as a Model has them (all but the name)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["name"]
        return out


@dataclass(frozen=True)
class Model:
    name: str
    aliases: tuple[str, ...]
    source: str
    sha256: str
    engine: str
    engine_version: str
    context: int
    parallel: int
    gpus: int
    args: tuple[str, ...]
    memory_bytes: int
    min: int
    max: int
    keep_alive_s: float
    fallbacks: tuple[str, ...]
    input_per_mtok: float = 0.0  # price per million prompt tokens
    output_per_mtok: float = 0.0  # ... and per million completion tokens
    # Autoscaling between min and max ([models.scaling]; lib/llmgw/scaling.py).
    target_queue_wait_s: float = 5.0
    up_after_s: float = 30.0
    down_below: float = 0.3
    down_after_s: float = 300.0
    cooldown_s: float = 120.0
    # Nodes one replica spans (lib/llmgw/gangs.py): 1, 2-64, or gangs.AUTO (0) for "auto".
    nodes: int = 1
    kv_cache_gib: int = 0  # vLLM on CPU: its KV space (0: the engine's default)
    # LoRA adapters each replica keeps loaded at most (0: it takes none).
    max_adapters: int = 0
    # A LoRA adapter: the model whose replicas serve it ("": a model of its own). Its
    # engine and profile are its base's; it has no replicas, min or max of its own.
    adapter_of: str = ""
    # profile.pipeline_parallel / tensor_parallel as set (0: the engine's layout decides).
    pipeline_parallel: int = 0
    tensor_parallel: int = 0
    # The profile the fields above are (the first of `profiles`, or the one `at` chose),
    # and every profile of the model in the order they are tried (empty: the fields above,
    # named "default").
    profile_name: str = DEFAULT
    profiles: tuple[Profile, ...] = ()

    def at(self, name: str) -> "Model | None":
        """The model as a replica that runs profile `name` sees it (None: no such
        profile); "" is the first."""
        if not self.profiles:
            return self if name in ("", self.profile_name) else None
        for p in self.profiles:
            if p.name == name or not name:
                if p.name == self.profile_name:
                    return self
                return dataclasses.replace(self, profile_name=p.name, **p.fields())
        return None

    def options(self) -> tuple["Model", ...]:
        """The model at each of its profiles, in the order placement tries them."""
        if not self.profiles:
            return (self,)
        return tuple(self.at(p.name) for p in self.profiles)

    def profile_named(self, digest: str) -> str:
        """The name of the profile whose profile_hash is `digest` ("": none of them): what
        a replica reported by an agent that does not say its profile's name runs."""
        for m in self.options():
            if m.profile_hash() == digest:
                return m.profile_name
        return ""

    def definition_hash(self) -> str:
        """What changes any of its replicas: its profile_hash with one profile (as before
        profiles had names), else every profile's name and hash, in order."""
        options = self.options()
        if len(options) == 1:
            return self.profile_hash()
        key = [[m.profile_name, m.profile_hash()] for m in options]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    @property
    def split(self) -> bool:
        """A replica of it may span several nodes (profile.nodes is not 1)."""
        return self.nodes != 1

    def scaling(self) -> Settings:
        return Settings(self.min, self.max, self.target_queue_wait_s, self.up_after_s,
                        self.down_below, self.down_after_s, self.cooldown_s)  # fmt: skip

    @property
    def engine_id(self) -> str:
        """`llama.cpp-0.3.36`: an engine and version as agents install and report them."""
        return f"{self.engine}-{self.engine_version}"

    def profile_hash(self) -> str:
        """What changes a replica's memory use or command: a changed profile is a new one."""
        key = [
            self.source,
            self.sha256,
            self.engine_id,
            self.context,
            self.parallel,
            self.gpus,
            list(self.args),
        ]
        if self.nodes != 1:  # only then: the hash of every one-node profile stays as it was
            key.append(["nodes", self.nodes])
        if self.kv_cache_gib:
            key.append(["kv_cache_gib", self.kv_cache_gib])
        if self.max_adapters:
            key.append(["max_adapters", self.max_adapters])
        if self.pipeline_parallel or self.tensor_parallel:
            key.append(["parallel", self.pipeline_parallel, self.tensor_parallel])
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return {
            "name": self.name, "aliases": list(self.aliases), "source": self.source,
            "sha256": self.sha256, "engine": self.engine, "engine_version": self.engine_version,
            "context": self.context, "parallel": self.parallel, "gpus": self.gpus,
            "args": list(self.args), "memory_bytes": self.memory_bytes,
            "min": self.min, "max": self.max,
            "nodes": "auto" if self.nodes == AUTO else self.nodes,
            "kv_cache_gib": self.kv_cache_gib, "max_adapters": self.max_adapters,
            "adapter_of": self.adapter_of or None,
            "pipeline_parallel": self.pipeline_parallel,
            "tensor_parallel": self.tensor_parallel,
            "profile": self.profile_name,
            "profiles": [{"name": m.profile_name, "context": m.context,
                          "parallel": m.parallel, "gpus": m.gpus, "args": list(m.args),
                          "memory_bytes": m.memory_bytes}
                         for m in self.options()] if not self.adapter_of else [],
            "fallbacks": list(self.fallbacks),
            "pricing": {"input_per_mtok": self.input_per_mtok,
                        "output_per_mtok": self.output_per_mtok},
        }  # fmt: skip

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What a request cost at this model's prices."""
        return (prompt_tokens * self.input_per_mtok
                + completion_tokens * self.output_per_mtok) / 1e6  # fmt: skip


def _nodes(m: ModelConfig, p: ProfileConfig, where: str, engine: engines.Engine | None,
           bad) -> int:  # fmt: skip
    """profile.nodes checked: 1, 2-64 or "auto" (AUTO); only an engine that spans nodes
    may ask for it."""
    value = p.nodes
    if value == "auto":
        nodes = AUTO
    elif isinstance(value, int) and 1 <= value <= MAX_NODES:
        nodes = value
    else:
        raise bad(f"{where}.nodes", f'must be 1-{MAX_NODES} or "auto", not {value!r}')
    if nodes == 1:
        return nodes
    if engine is None or not engine.spans_nodes:
        spanning = ", ".join(n for n in engines.names() if engines.get(n).spans_nodes)
        raise bad(f"{where}.nodes", f"must be 1 for {m.engine}: its replicas do not span"
                  f" nodes yet (docs/multinode.md; engines that do: {spanning})")  # fmt: skip
    if p.gpus:
        raise bad(f"{where}.nodes", f"must be 1 with {where}.gpus: a {m.engine} replica"
                  " across nodes runs on CPUs only for now")  # fmt: skip
    return nodes


def _adapter(m: ModelConfig, kind: str, bad) -> None:
    """An adapter's own fields checked (its base is checked once all are read): a PEFT
    directory as its source, and nothing of a replica's, which its base's replicas have."""
    if kind not in ("path", "hf") or (kind == "hf" and hub.parse(m.source).file):
        raise bad("source", "must be a PEFT directory (adapter_config.json and"
                  " adapter_model.safetensors): a path or hf://ORG/REPO[@REVISION]")  # fmt: skip
    if m.profiles is not None:
        raise bad("profiles", "must not be set for an adapter: it runs on the replicas of"
                  f" '{m.adapter_of}'")  # fmt: skip
    if m.profile != ProfileConfig():
        raise bad("profile", "must not be set for an adapter: it runs on the replicas of"
                  f" '{m.adapter_of}' (set profile.max_adapters there)")  # fmt: skip
    if m.scaling != ScalingConfig():
        raise bad("scaling", "must not be set for an adapter: it is loaded on a replica of"
                  f" '{m.adapter_of}' when a request asks for it")  # fmt: skip
    if m.engine_version:
        raise bad("engine_version", f"must not be set for an adapter: it is '{m.adapter_of}'s")


def _bind_adapters(out: list["Model"], configs: list[ModelConfig], names: dict) -> list["Model"]:
    """Each adapter checked against its base and given the base's engine and profile."""
    by_name = {m.name: m for m in out}
    bound = []
    for model, m in zip(out, configs, strict=True):
        if not model.adapter_of:
            bound.append(model)
            continue

        def bad(field: str, why: str, name=model.name):
            return ConfigError(f"model '{name}': {field} {why}")

        base = by_name.get(names.get(model.adapter_of, ""))
        if base is None:
            raise bad("adapter_of", f"names unknown model {model.adapter_of!r}")
        if base.adapter_of:
            raise bad("adapter_of", f"names '{base.name}', itself an adapter of"
                      f" '{base.adapter_of}': name a model with replicas")  # fmt: skip
        engine = engines.get(base.engine)
        if engine is None or engine.adapters is None:
            takes = ", ".join(n for n in engines.names() if engines.get(n).adapters)
            raise bad("adapter_of", f"names '{base.name}', whose engine {base.engine} cannot"
                      f" load adapters at runtime (engines that can: {takes})")  # fmt: skip
        if base.max_adapters < 1:
            raise bad("adapter_of", f"names '{base.name}', whose profile.max_adapters is 0:"
                      " set it to 1 or more")  # fmt: skip
        if m.engine not in (ModelConfig.engine, base.engine):
            raise bad("engine", f"must be '{base.engine}' (its base's) or not set")
        bound.append(dataclasses.replace(
            base, name=model.name, aliases=model.aliases, source=model.source,
            sha256=model.sha256, fallbacks=model.fallbacks, min=0, max=0,
            input_per_mtok=model.input_per_mtok, output_per_mtok=model.output_per_mtok,
            max_adapters=0, adapter_of=base.name, memory_bytes=0,
        ))  # fmt: skip
    return bound


def _layout(p, where: str, nodes: int, engine: engines.Engine | None, bad) -> None:
    """profile.pipeline_parallel and tensor_parallel against the nodes and GPUs: on one
    node tensor parallel is over its GPUs and there is no pipeline; across nodes the
    engine says what fits (vLLM: pipeline × tensor = every rank)."""
    if nodes == 1:
        if p.tensor_parallel > max(p.gpus, 1):
            raise bad(
                f"{where}.tensor_parallel",
                f"must be at most {where}.gpus ({p.gpus}), the GPUs of each node",
            )
        if p.pipeline_parallel > 1:
            raise bad(f"{where}.pipeline_parallel",
                      "must be 0 or 1 on one node: a pipeline's stages are nodes"
                      " (profile.nodes, docs/multinode.md)")  # fmt: skip
        return
    if engine is None or engine.layout is None:
        return
    if nodes == AUTO:
        if p.pipeline_parallel or p.tensor_parallel:
            raise bad(f"{where}.nodes", '"auto" leaves the number of nodes to placement:'
                      " give it as a number with pipeline_parallel or tensor_parallel")  # fmt: skip
        return
    try:
        engine.layout(nodes, p.gpus, p.pipeline_parallel, p.tensor_parallel)
    except ValueError as e:
        raise bad(where, f"{e} ({where}.nodes = {nodes})") from None


def _profile(m: ModelConfig, p: ProfileConfig, where: str, engine: engines.Engine | None,
             bad) -> Profile:  # fmt: skip
    """One profile checked; `where` names it in errors ("profile", "profiles[1]")."""
    if p.context < 256:
        raise bad(f"{where}.context", "must be at least 256")
    if not 1 <= p.parallel <= 256:
        raise bad(f"{where}.parallel", "must be 1-256")
    if p.memory_bytes < 0:
        raise bad(f"{where}.memory_bytes", "must not be negative")
    if p.gpus < 0:
        raise bad(f"{where}.gpus", "must not be negative")
    if engine is not None and engine.needs_gpus and p.gpus == 0:
        raise bad(f"{where}.gpus", f"must be at least 1 for the {m.engine} engine")
    if engine is not None and p.gpus and not engines.uses_gpus(engine.accelerators):
        # It would book GPUs and compute on the CPU. An engine that has a GPU build
        # (llama.cpp with CUDA) is taken here; a node whose build is the CPU's is
        # refused by placement.
        raise bad(f"{where}.gpus", f"must be 0: the {m.engine} engine cannot use a GPU"
                  f" (built for {engines.built_for(engine.accelerators)})")  # fmt: skip
    if p.kv_cache_gib < 0:
        raise bad(f"{where}.kv_cache_gib", "must not be negative")
    if p.kv_cache_gib and (engine is None or engine.estimate_config is None):
        raise bad(f"{where}.kv_cache_gib", "applies to the vllm engine only")
    if p.max_adapters < 0:
        raise bad(f"{where}.max_adapters", "must not be negative")
    if p.max_adapters and (engine is None or engine.adapters is None):
        takes = ", ".join(n for n in engines.names() if engines.get(n).adapters)
        raise bad(f"{where}.max_adapters", f"applies to engines that load LoRA adapters"
                  f" at runtime only ({takes}), not {m.engine}")  # fmt: skip
    nodes = _nodes(m, p, where, engine, bad)
    for key in ("tensor_parallel", "pipeline_parallel"):
        value = getattr(p, key)
        if value < 0:
            raise bad(f"{where}.{key}", "must not be negative")
        if value and (engine is None or not engine.parallelism):
            takes = ", ".join(n for n in engines.names() if engines.get(n).parallelism)
            raise bad(f"{where}.{key}", f"applies to the {takes} engine only")
    _layout(p, where, nodes, engine, bad)
    return Profile(
        name=p.name or DEFAULT, context=p.context, parallel=p.parallel, gpus=p.gpus,
        args=tuple(p.args), memory_bytes=p.memory_bytes, nodes=nodes,
        kv_cache_gib=p.kv_cache_gib, max_adapters=p.max_adapters,
        pipeline_parallel=p.pipeline_parallel, tensor_parallel=p.tensor_parallel,
    )  # fmt: skip


def _profiles(m: ModelConfig, engine: engines.Engine | None, bad) -> tuple[Profile, ...]:
    """`profile` (one, named "default") or `[[models.profiles]]` (named, tried in order),
    each checked; never both."""
    if m.profiles is None:
        if m.profile.name:
            raise bad("profile.name", "must not be set: name profiles in [[models.profiles]]")
        return (_profile(m, m.profile, "profile", engine, bad),)
    if m.profile != ProfileConfig():
        raise bad("profiles", "and profile must not both be given: put the one profile in"
                  " [[models.profiles]] with a name")  # fmt: skip
    if not m.profiles:
        raise bad("profiles", "must not be empty: give one [[models.profiles]] or more")
    out: list[Profile] = []
    for i, p in enumerate(m.profiles):
        where = f"profiles[{i}]"
        if not _PROFILE.match(p.name):
            raise bad(f"{where}.name", "must be 1-64 letters, digits or ._- and start"
                      " alphanumeric")  # fmt: skip
        if any(o.name == p.name for o in out):
            raise bad(f"{where}.name", f"{p.name!r} is already the name of another profile")
        profile = _profile(m, p, where, engine, bad)
        if profile.nodes != 1 and len(m.profiles) > 1:
            raise bad(f"{where}.nodes", "must be 1 when a model has several profiles: a"
                      " replica across nodes takes the model's one profile")  # fmt: skip
        out.append(profile)
    return tuple(out)


def source_kind(source: str) -> str:
    """path, file, https, pypi or hf."""
    if source.startswith("pypi:"):
        return "pypi"
    if source.startswith(hub.PREFIX):
        return "hf"
    if source.startswith("file://"):
        return "file"
    if source.startswith("https://") or source.startswith("http://"):
        return "https"
    return "path"


def from_config(cfg) -> list[Model]:
    """The config's catalog, checked as every tool checks it at start (the scheduler, the
    router and `llmgw config check` call this one function, so "ok" means they start):
    the engines an agent adds with [[agent.engines]] count as known."""
    return load(cfg.models, extra_engines={e.name for e in cfg.agent.engines})


def load(models: list[ModelConfig], extra_engines: set[str] = frozenset()) -> list[Model]:
    """Check every definition; the first problem is a ConfigError naming model and field."""
    out: list[Model] = []
    names: dict[str, str] = {}
    for i, m in enumerate(models):
        label = f"model '{m.name}'" if m.name else f"models[{i}]"

        def bad(field: str, why: str, label=label):
            return ConfigError(f"{label}: {field} {why}")

        if not m.name or not _NAME.match(m.name):
            raise bad("name", "must be 1-200 letters, digits or ._:/- and start alphanumeric")
        for alias in (m.name, *m.aliases):
            if not _NAME.match(alias):
                raise bad("aliases", f"has an invalid name {alias!r}")
            if alias in names:
                raise bad(
                    "name" if alias == m.name else "aliases",
                    f"{alias!r} is already used by model '{names[alias]}'",
                )
            names[alias] = m.name
        if not m.source:
            raise bad("source", "is missing: a GGUF path, file:// or https:// URL, pypi:PACKAGE"
                      " or hf://ORG/REPO[@REVISION][/FILE]")  # fmt: skip
        kind = source_kind(m.source)
        if kind == "hf":
            try:
                hub.parse(m.source)
            except hub.SourceError as e:
                raise bad("source", str(e)) from None
        if m.sha256 and not _SHA256.match(m.sha256):
            raise bad("sha256", "must be 64 lower-case hex digits")
        if kind in ("https", "file") and not m.sha256:
            raise bad("sha256", f"is required for a {kind} source, so a wrong file is never used")
        if kind == "https" and m.source.startswith("http://"):
            raise bad("source", "must be https://, not http://")
        if m.adapter_of:
            _adapter(m, kind, bad)
            out.append(Model(
                name=m.name, aliases=tuple(m.aliases), source=m.source, sha256=m.sha256,
                engine="", engine_version="", context=0, parallel=0, gpus=0, args=(),
                memory_bytes=0, min=0, max=0, keep_alive_s=0.0, fallbacks=tuple(m.fallbacks),
                input_per_mtok=m.pricing.input_per_mtok,
                output_per_mtok=m.pricing.output_per_mtok, adapter_of=m.adapter_of,
            ))  # fmt: skip
            if m.pricing.input_per_mtok < 0 or m.pricing.output_per_mtok < 0:
                raise bad("pricing", "prices must not be negative")
            continue
        engine = engines.get(m.engine)
        if engine is None and m.engine not in extra_engines:
            known = ", ".join(sorted({*engines.names(), *extra_engines}))
            raise bad("engine", f"{m.engine!r} is not known (known: {known})")
        version = m.engine_version or (engine.default_version if engine else "")
        if not version:
            raise bad("engine_version", "is missing")
        profiles = _profiles(m, engine, bad)
        s = m.scaling
        if s.keep_alive_s < 0:
            raise bad("scaling.keep_alive_s", "must not be negative")
        if s.min < 0 or s.max < 1 or s.min > s.max:
            raise bad("scaling", f"min {s.min} / max {s.max}: want 0 <= min <= max, max >= 1")
        for key in ("target_queue_wait_s", "up_after_s", "down_after_s", "cooldown_s"):
            if getattr(s, key) < 0:
                raise bad(f"scaling.{key}", "must not be negative")
        if not 0 <= s.down_below <= 1:
            raise bad("scaling.down_below", "must be between 0 and 1")
        price = m.pricing
        if price.input_per_mtok < 0 or price.output_per_mtok < 0:
            raise bad("pricing", "prices must not be negative")
        first = profiles[0]
        out.append(Model(
            name=m.name, aliases=tuple(m.aliases), source=m.source, sha256=m.sha256,
            engine=m.engine, engine_version=version, **first.fields(),
            profile_name=first.name, profiles=profiles if len(profiles) > 1 else (),
            min=s.min, max=s.max, keep_alive_s=s.keep_alive_s,
            fallbacks=tuple(m.fallbacks), input_per_mtok=price.input_per_mtok,
            output_per_mtok=price.output_per_mtok,
            target_queue_wait_s=s.target_queue_wait_s, up_after_s=s.up_after_s,
            down_below=s.down_below, down_after_s=s.down_after_s, cooldown_s=s.cooldown_s,
        ))  # fmt: skip
    out = _bind_adapters(out, models, names)
    for model in out:
        for fb in model.fallbacks:
            if fb not in names:
                raise ConfigError(f"model '{model.name}': fallbacks names unknown model {fb!r}")
            if names[fb] == model.name:
                raise ConfigError(f"model '{model.name}': fallbacks must not name itself")
    return out
