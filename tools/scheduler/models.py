"""The catalog the scheduler places: the config's models, plus those added at runtime
(`llmgw models add`), with `llmgw scale` overrides applied."""

import dataclasses
import json

from llmgw import catalog, config, log
from llmgw.catalog import Model
from llmgw.errors import ConfigError, Conflict, Invalid, NotFound
from llmgw.store import ModelScale, RuntimeModel

_log = log.get("llmgw.scheduler")


def profile_of(m: Model, r) -> str:
    """The name of the profile replica `r` of `m` runs: the one it recorded, else the one
    whose hash it reported (an agent from before profiles had names); "" if neither."""
    return r.profile_name or m.profile_named(r.profile)


class Catalog:
    def __init__(self, models: list[Model], config_names: set[str] = frozenset(),
                 extra_engines: set[str] = frozenset()):  # fmt: skip
        self.models = {m.name: m for m in models if not m.adapter_of}
        # LoRA adapters: models clients name, served by their base's replicas (adapters.py).
        self.adapters = {m.name: m for m in models if m.adapter_of}
        self.by_alias = {a: m.name for m in models for a in (m.name, *m.aliases)}
        self.configs: list = []  # the raw definitions behind self.models
        self.config_names = set(config_names)  # those that came from the config file
        self.extra_engines = set(extra_engines)

    def get(self, name: str) -> Model:
        """The model `name`, or NotFound."""
        m = self.models.get(name)
        if m is None:
            raise NotFound(f"no model '{name}'", "model_not_found")
        return m

    def of_replica(self, r) -> Model | None:
        """The model as replica `r` runs it (at its profile); None if the model or that
        profile is no longer in the catalog."""
        m = self.models.get(r.model)
        if m is None:
            return None
        name = profile_of(m, r)
        return m.at(name) if name else None

    def entry(self, name: str) -> Model:
        """The model or LoRA adapter `name` (whose weights the mirror keeps), or NotFound."""
        a = self.adapters.get(name)
        return a if a is not None else self.get(name)

    def install(self, configs: list) -> None:
        """Check `configs` as a whole (names, aliases, fallbacks), apply `llmgw scale`
        overrides and make them the catalog. Raises ConfigError and changes nothing
        if any definition is wrong."""
        checked = catalog.load(configs, self.extra_engines)
        scales = {row.name: row for row in ModelScale.select()}
        models = {}
        for m in checked:
            if m.adapter_of:
                continue
            s = scales.get(m.name)
            models[m.name] = dataclasses.replace(m, min=s.min, max=s.max) if s else m
        self.configs = list(configs)
        self.models = models
        self.adapters = {m.name: m for m in checked if m.adapter_of}
        self.by_alias = {a: m.name for m in checked for a in (m.name, *m.aliases)}

    def load_runtime(self) -> None:
        """Add the models added with `llmgw models add`; one that no longer fits beside
        the config's (a name now taken there, say) is skipped with a log line."""
        for row in RuntimeModel.select().order_by(RuntimeModel.created_at):
            try:
                mc = config.model_from(json.loads(row.definition), f"model '{row.name}'")
                self.install([*self.configs, mc])
            except (ConfigError, ValueError) as e:
                _log.error("runtime_model_skipped", model=row.name, reason=str(e))

    def reload(self) -> None:
        """The config's models and the store's runtime ones, as a new leader reads them."""
        self.install([mc for mc in self.configs if mc.name in self.config_names])
        self.load_runtime()

    def add(self, data: dict, now: float) -> Model:
        """`llmgw models add`: check, install and keep a new model definition. Raises
        Conflict for a name taken, Invalid for a definition that is wrong."""
        try:
            mc = config.model_from(data, f"model '{data.get('name', '?')}'")
            if mc.name in self.by_alias:
                raise Conflict(f"model '{mc.name}' exists already", "invalid_model")
            self.install([*self.configs, mc])
        except ConfigError as e:
            raise Invalid(str(e), "invalid_model") from None
        RuntimeModel.insert(name=mc.name, definition=json.dumps(data), created_at=now).execute()
        _log.info("model_added", model=mc.name)
        return self.models[mc.name]

    def remove(self, name: str) -> None:
        """`llmgw models remove`: only runtime models."""
        if name in self.config_names:
            raise Conflict(
                f"model '{name}' is defined in the config file: remove it there",
                "defined_in_config",
            )
        if RuntimeModel.get_or_none(RuntimeModel.name == name) is None:
            raise NotFound(f"no runtime model '{name}'", "model_not_found")
        self.install([mc for mc in self.configs if mc.name != name])
        RuntimeModel.delete().where(RuntimeModel.name == name).execute()
        ModelScale.delete().where(ModelScale.name == name).execute()
        _log.info("model_removed", model=name)

    def scale(self, name: str, min_: int, max_: int, now: float) -> None:
        """`llmgw scale`: new bounds that outlive restarts and definition edits."""
        self.get(name)
        if min_ < 0 or max_ < 1 or min_ > max_:
            raise Invalid(f"min {min_} / max {max_}: want 0 <= min <= max, max >= 1")
        fields = {"min": min_, "max": max_, "updated_at": now}
        (
            ModelScale.insert(name=name, **fields)
            .on_conflict(conflict_target=[ModelScale.name], update=fields)
            .execute()
        )
        self.install(self.configs)
        _log.info("model_scaled", model=name, min=min_, max=max_)
