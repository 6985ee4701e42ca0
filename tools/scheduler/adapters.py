"""LoRA adapters on their base's replicas: which replica holds which adapter, where a
wanted one goes, and what each agent is told to load.

An adapter (a catalog model with `adapter_of`) has no replicas of its own. A router
with no replica serving it asks for it with a `want`, as for an on-demand model (its
request waits the activation window, no longer). The pass gives it to a ready replica of
its base (`choose`): one that holds it already, else the one with room (fewest
adapters), else the one whose least recently used adapter was used longest ago, which
is unloaded for it. The replica's whole set goes to its agent as `set_adapters`; the
agent fetches what is new (the mirror first, like weights) and loads it into the engine,
unloads what went, and reports what is loaded in the shard's `adapters`. The routing
table lists an adapter on a replica once it is both given there and reported loaded, so
a router never sends a request to an engine that does not have it, and an evicted one
stops being routed there at once. The agent loads, not the router: the files are the
node's, and the router must never wait on a fetch.
"""

from dataclasses import dataclass

from llmgw import log
from llmgw.states import ModelState, MsgType, ShardState

_log = log.get("llmgw.scheduler")

# A replica's set is sent again this often while its agent reports another one.
RESEND_S = 5.0
# A want for an adapter whose base has no ready replica is kept this long for one to be.
WANT_S = 60.0
_NEVER = float("-inf")


@dataclass(frozen=True)
class Holding:
    """A ready replica of the base and the adapters it is given now."""

    replica: str
    adapters: tuple[str, ...]


def choose(adapter: str, holdings: list[Holding], max_adapters: int,
           last_used: dict[str, float]) -> tuple[str, str] | None:  # fmt: skip
    """(replica, adapter to unload there or "") for `adapter`; None with no replica. One
    that holds it, else the one with most room, else the one whose least recently used
    adapter is the least recently used of all (ties by id, alike in every scheduler)."""
    if not holdings:
        return None
    for h in holdings:
        if adapter in h.adapters:
            return h.replica, ""
    room = [h for h in holdings if len(h.adapters) < max_adapters]
    if room:
        return min(room, key=lambda h: (len(h.adapters), h.replica)).replica, ""

    def oldest(h: Holding) -> str:
        return min(h.adapters, key=lambda a: (last_used.get(a, _NEVER), a))

    best = min(holdings, key=lambda h: (last_used.get(oldest(h), _NEVER), h.replica))
    return best.replica, oldest(best)


def trim(adapters: list[str], max_adapters: int, last_used: dict[str, float]) -> list[str]:
    """At most `max_adapters` of them, the least recently used left out."""
    if len(adapters) <= max_adapters:
        return adapters
    keep = sorted(adapters, key=lambda a: (last_used.get(a, _NEVER), a))[-max_adapters:]
    return [a for a in adapters if a in keep]


class Adapters:
    def __init__(self, catalog, inv, outbox, demand, flags, mirror_of):
        self.catalog = catalog
        self.inv = inv
        self.outbox = outbox
        self.demand = demand  # its last_active is each adapter's last use
        self.flags = flags
        self.mirror_of = mirror_of  # (adapter name, node) -> a start's `mirror`, or None
        self.given: dict[str, list[str]] = {}  # replica -> the adapters it is given
        self.wanted: dict[str, float] = {}  # adapter -> when a router last asked
        self._sent: dict[str, tuple[tuple[str, ...], float]] = {}  # replica -> (set, when)

    def want(self, adapter: str, now: float) -> None:
        self.wanted[adapter] = now

    def _ready(self, base: str, lost: set[str]) -> list:
        return [r for r in self.inv.of_model(base)
                if r.state == ShardState.READY and r.node not in lost]  # fmt: skip

    def pass_(self, now: float) -> None:
        """Give wanted adapters a replica, and tell agents whose replicas' sets differ."""
        adapters, models = self.catalog.adapters, self.catalog.models
        for rid in [rid for rid in self.given if rid not in self.inv.replicas]:
            del self.given[rid]
            self._sent.pop(rid, None)
        lost = self.inv.lost_nodes()
        last_used = self.demand.last_active
        for base in {a.adapter_of for a in adapters.values()}:
            m = models.get(base)
            if m is None:
                continue
            ready = self._ready(base, lost)
            for r in ready:  # a new leader learns each replica's set from its agent
                if r.id not in self.given:
                    self.given[r.id] = [a for a in r.adapters if a in adapters]
                kept = trim(self.given[r.id], m.max_adapters, last_used)
                if kept != self.given[r.id]:
                    self.given[r.id] = kept
            for name in sorted(a for a in self.wanted if adapters.get(a) and
                               adapters[a].adapter_of == base):  # fmt: skip
                holdings = [Holding(r.id, tuple(self.given[r.id])) for r in ready]
                choice = choose(name, holdings, m.max_adapters, last_used)
                if choice is None:
                    if now - self.wanted[name] > WANT_S:
                        del self.wanted[name]
                    continue
                del self.wanted[name]
                rid, evicted = choice
                held = self.given[rid]
                if name in held:
                    continue
                if evicted:
                    held.remove(evicted)
                    _log.info("adapter_evicted", adapter=evicted, replica=rid, base=base,
                              to_load=name)  # fmt: skip
                held.append(name)
                _log.info("adapter_given", adapter=name, replica=rid, base=base)
                self.flags.routes_dirty = True
        for a in [a for a in self.wanted if a not in adapters]:
            del self.wanted[a]
        self._tell(now)

    def _tell(self, now: float) -> None:
        for rid, held in self.given.items():
            r = self.inv.replicas[rid]
            want = tuple(held)
            if tuple(r.adapters) == want:
                continue
            sent = self._sent.get(rid)
            if sent is not None and sent[0] == want and now - sent[1] < RESEND_S:
                continue
            self._sent[rid] = (want, now)
            body = {"id": rid, "adapters": [self._spec(a, r.node) for a in want]}
            self.outbox.send(r.node, MsgType.SET_ADAPTERS, body)

    def _spec(self, name: str, node: str) -> dict:
        a = self.catalog.adapters[name]
        spec = {"name": name, "source": a.source, "sha256": a.sha256}
        mirror = self.mirror_of(name, node)
        if mirror is not None:
            spec["mirror"] = mirror
        return spec

    def serving(self, replica) -> list[str]:
        """The adapters routers may send to `replica`: given there and loaded."""
        return [a for a in self.given.get(replica.id, ()) if a in replica.adapters]

    def loaded_on(self, adapter: str) -> list:
        """The replicas serving `adapter` now."""
        return [r for rid, held in self.given.items() if adapter in held
                and (r := self.inv.replicas.get(rid)) is not None
                and r.state == ShardState.READY and adapter in r.adapters]  # fmt: skip

    def status(self, adapter: str, base_status) -> tuple[str, str]:
        """(state, reason): serving where loaded, else its base's (a base that will not
        come up is why), starting while it is wanted or being loaded, else stopped."""
        if self.loaded_on(adapter):
            return ModelState.SERVING, ""
        base = self.catalog.adapters[adapter].adapter_of
        state, reason = base_status(base)
        if state in (ModelState.PARKED, ModelState.UNPLACEABLE, ModelState.BACKOFF):
            return state, f"its base '{base}': {reason}"
        if adapter in self.wanted or any(adapter in h for h in self.given.values()):
            return ModelState.STARTING, ""
        return ModelState.STOPPED, ""
