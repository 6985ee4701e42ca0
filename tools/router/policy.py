"""What applies to a key: its band, who it belongs to, the counters of every limit and
budget on it, its user, project, their teams and org; and the catalog's prices,
fallbacks and slots.

A background worker mirrors users, projects, limits, budgets and runtime models from
the store on the one connection it keeps, as keycache.py mirrors keys: it checks each
table's row count and newest change every `router.limits_refresh_s`, reloads all of
them when one moved, and swaps the new state in with one assignment. The request path
asks `policy(key)`, a dict lookup once the key's policy has been built.
"""

import json
import threading
from dataclasses import dataclass

import peewee

from llmgw import catalog, config, log
from llmgw.errors import ConfigError
from llmgw.store import RuntimeModel
from llmgw.store.tenancy import Budget, Limit, Project, User
from llmgw.worker import Worker
from llmgw_router.keycache import Key
from llmgw_router.limits import Limiter

_log = log.get("llmgw.router.policy")

_COST_SCALE = 1_000_000


@dataclass(frozen=True, slots=True)
class Attribution:
    user: str | None = None
    project: str | None = None
    team: str | None = None
    org: str | None = None


NOBODY = Attribution()


class Policy:
    """Everything the request path needs to know about one key."""

    __slots__ = ("key", "band", "who", "ones", "tokens", "costs", "rpm", "tpm", "generation",
                 "entries", "heads")  # fmt: skip

    def __init__(self, key: Key, band: int, who: Attribution, generation: int):
        self.key = key
        self.band = band  # index into router.bands: 0 is the highest
        self.who = who
        self.ones: list = []  # counters a request takes 1 from: rpm, concurrent
        self.tokens: list = []  # tpm and token budgets: estimated prompt + max_tokens
        self.costs: list = []  # cost budgets: the estimate's price
        self.rpm: list = []  # for the x-ratelimit-* headers
        self.tpm: list = []
        self.generation = generation
        self.entries: tuple = ()  # (counter, which amount it takes): see Quota.ask
        self.heads: tuple = ()  # the smallest rpm and tpm limits, for the headers

    @property
    def limited(self) -> bool:
        return bool(self.entries)

    def seal(self) -> "Policy":
        """Fix what the request path reads, once: each counter with the amount it takes
        (0: one request, 1: tpm's estimate, 2: a budget's upper bound, 3: its cost)."""
        entries = [(c, 0) for c in self.ones]
        entries += [(c, 1 if c.kind == "tpm" else 2) for c in self.tokens]
        entries += [(c, 3) for c in self.costs]
        self.entries = tuple(entries)
        heads = []
        for unit, counters in (("requests", self.rpm), ("tokens", self.tpm)):
            if counters:
                heads.append((unit, min(counters, key=lambda c: c.limit)))
        self.heads = tuple(heads)
        return self


class State:
    """One consistent snapshot of the mirrored tables."""

    def __init__(self, users=None, projects=None, limits=None, budgets=None, models=None):
        self.users: dict = users or {}  # name -> (org, team)
        self.projects: dict = projects or {}  # name -> (org, team, band)
        self.limits: dict = limits or {}  # (scope, subject) -> (rpm, tpm, concurrent)
        self.budgets: dict = budgets or {}  # (scope, subject) -> [(period, tokens, cost)]
        self.models: dict = models or {}  # name or alias -> catalog.Model


class Policies:
    def __init__(
        self,
        limiter: Limiter,
        bands: list[str],
        default_band: str,
        models: list = (),
        extra_engines=frozenset(),
        refresh_s: float = 2.0,
    ):
        self.limiter = limiter
        self.bands = list(bands) or ["default"]
        default = default_band if default_band in self.bands else self.bands[-1]
        self.default_band = self.bands.index(default)
        self.config_models = list(models)  # ModelConfig from [[models]]
        self.extra_engines = set(extra_engines)
        self.refresh_s = refresh_s
        self.state = State(models=self._catalog([]))
        self.generation = 0
        self._cache: dict[str, Policy] = {}
        self._version = None
        self.loaded = threading.Event()
        self.worker: Worker | None = None

    # -- the request path ---------------------------------------------------------------

    def policy(self, key: Key) -> Policy:
        p = self._cache.get(key.id)
        if p is not None and p.key is key and p.generation == self.generation:
            return p
        p = self._build(key)
        self._cache[key.id] = p
        return p

    def model(self, name: str):
        """The catalog's definition of a model or alias (None: not in the catalog)."""
        return self.state.models.get(name)

    def band_index(self, name: str) -> int:
        try:
            return self.bands.index(name)
        except ValueError:
            return self.default_band

    def _build(self, key: Key) -> Policy:
        st, lim = self.state, self.limiter
        user = st.users.get(key.user) if key.user else None
        project = st.projects.get(key.project) if key.project else None
        band = key.band or (project[2] if project else "")
        team = (project[1] if project else None) or (user[1] if user else None)
        org = (project[0] if project else None) or (user[0] if user else None)
        who = Attribution(key.user, key.project, team, org) if (user or project) else NOBODY
        p = Policy(key, self.band_index(band) if band else self.default_band, who,
                   self.generation)  # fmt: skip
        subjects = [("key", key.id)]
        if key.user:
            subjects.append(("user", key.user))
        if key.project:
            subjects.append(("project", key.project))
        for team_name in dict.fromkeys(t for t in (user and user[1], project and project[1]) if t):
            subjects.append(("team", team_name))
        for org_name in dict.fromkeys(o for o in (user and user[0], project and project[0]) if o):
            subjects.append(("org", org_name))
        for scope, subject in subjects:
            limits = st.limits.get((scope, subject))
            if limits:
                rpm, tpm, concurrent = limits
                if rpm is not None:
                    c = lim.counter("rpm", scope, subject, rpm)
                    p.ones.append(c)
                    p.rpm.append(c)
                if concurrent is not None:
                    p.ones.append(lim.counter("concurrent", scope, subject, concurrent))
                if tpm is not None:
                    c = lim.counter("tpm", scope, subject, tpm)
                    p.tokens.append(c)
                    p.tpm.append(c)
            for period, tokens, cost in st.budgets.get((scope, subject), ()):
                if tokens is not None:
                    p.tokens.append(lim.counter(f"tokens/{period}", scope, subject, tokens))
                if cost is not None:
                    units = round(cost * _COST_SCALE)
                    p.costs.append(lim.counter(f"cost/{period}", scope, subject, units))
        return p.seal()

    # -- the mirror ---------------------------------------------------------------------

    def _catalog(self, runtime: list) -> dict:
        """Models by name and alias: the config's, then runtime ones that fit beside."""
        try:
            checked = catalog.load(self.config_models, self.extra_engines)
        except ConfigError as e:
            _log.error("catalog_invalid", reason=str(e))
            checked = []
        configs = list(self.config_models)
        for row in runtime:
            try:
                mc = config.model_from(json.loads(row.definition), f"model '{row.name}'")
                checked = catalog.load([*configs, mc], self.extra_engines)
                configs.append(mc)
            except (ConfigError, ValueError) as e:
                _log.warning("runtime_model_skipped", model=row.name, reason=str(e)[:200])
        return {a: m for m in checked for a in (m.name, *m.aliases)}

    def _tables(self):
        return (User, Project, Limit, Budget, RuntimeModel)

    def version(self) -> tuple:
        """Row count and newest change of each mirrored table: any change moves one."""
        out = []
        for t in self._tables():
            col = t.created_at if t is RuntimeModel else t.updated_at
            out.append(tuple(t.select(_count(), _max(col)).tuples()[0]))
        return tuple(out)

    def refresh(self) -> bool:
        """Reload everything if anything changed; True if it did."""
        version = self.version()
        if version == self._version:
            self.loaded.set()
            return False
        users = {u.name: (u.org, u.team) for u in User.select()}
        projects = {p.name: (p.org, p.team, p.band) for p in Project.select()}
        limits = {(r.scope, r.subject): (r.rpm, r.tpm, r.concurrent) for r in Limit.select()}
        budgets: dict = {}
        for b in Budget.select():
            budgets.setdefault((b.scope, b.subject), []).append((b.period, b.tokens, b.cost))
        runtime = list(RuntimeModel.select().order_by(RuntimeModel.created_at))
        self.state = State(users, projects, limits, budgets, self._catalog(runtime))
        self.generation += 1
        self._version = version
        self.loaded.set()
        return True

    def _tick(self) -> None:
        if self.refresh():
            _log.info("policies_loaded", users=len(self.state.users),
                      limits=len(self.state.limits), budgets=len(self.state.budgets))  # fmt: skip

    def start(self, db) -> None:
        # The store may be down: the worker says so once, and we keep what we have.
        self.worker = Worker("policies_refresh", self._tick, self.refresh_s, db=db, logger=_log)
        self.worker.start()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()


def _count():
    return peewee.fn.COUNT(peewee.SQL("*"))


def _max(col):
    return peewee.fn.MAX(col)
