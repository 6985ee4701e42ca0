"""The routing table: which endpoints serve which model, and which one to use next.

Pure bookkeeping, no I/O: the request path asks `pick()` for an endpoint and reports
back with `release()`/`failed()`. The table is filled from the config's static
endpoints, and the scheduler's feed (feed.py) replaces it with each routing table.
"""

import asyncio
import time
from dataclasses import dataclass, field

from llmgw_router.prefix import Key, Outcome, PrefixIndex, request_key

# router.routing: how a request's endpoint is chosen among a model's replicas.
ROUTINGS = ("least-outstanding", "prefix", "round-robin")


@dataclass(eq=False)
class Endpoint:
    id: str
    url: str  # the engine's root, e.g. http://127.0.0.1:8011
    models: tuple[str, ...]
    key: str = field(default="", repr=False)  # the engine's secret: never in a repr or a log
    outstanding: int = 0
    cooldown_until: float = 0.0
    last_used: float = 0.0  # time.monotonic() when its last request ended; 0: never
    head: bytes = field(default=b"", repr=False)  # header lines sent on every request
    signal: object = field(default=None, repr=False)  # the engine's own load (probe.py)
    engine: str = ""  # the scheduler's word on which engine it is ("": not said)

    def __post_init__(self):
        self.url = self.url.rstrip("/")
        head = "Content-Type: application/json\r\n"
        if self.key:
            head += f"Authorization: Bearer {self.key}\r\n"
        self.head = head.encode()


# An engine's word on its load (probe.py) older than this is not believed.
SIGNAL_STALE_S = 5.0


def _others(wall: float):
    """Requests other routers have in flight on an endpoint, as its engine said lately:
    its busy slots (vLLM: requests running) and the requests it queues itself, less
    this router's own requests then (0 when it did not say). Its own as they were when
    the engine answered, not as they are now: with those, a router alone counted its
    own requests that had ended since as someone else's. vLLM gives no slot count:
    requiring one left its load unread by the choice (tests/e2e/test_fleet_vllm.py)."""

    def others(ep) -> int:
        sig = ep.signal
        if sig is None or wall - sig.at > SIGNAL_STALE_S:
            return 0
        own = sig.own if sig.own is not None else ep.outstanding
        return max(0, sig.busy + sig.waiting - own)

    return others


def parse_endpoint_flag(text: str) -> Endpoint:
    """`ID=URL=MODEL[,MODEL]` as given to --endpoint."""
    parts = text.split("=")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"--endpoint {text!r}: want ID=URL=MODEL[,MODEL]")
    ident, url, models = parts
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint {text!r}: URL must start with http:// or https://")
    return Endpoint(ident, url, tuple(m for m in models.split(",") if m))


class RoutingTable:
    """Least outstanding requests among the endpoints of a model, skipping cooled ones;
    or where the prompt is cached (`routing="prefix"`, prefix.py), or in turn."""

    def __init__(self, endpoints: list[Endpoint] = (), cooldown_s: float = 5.0,
                 fed: bool = False, routing: str = "least-outstanding",
                 prefix: PrefixIndex | None = None, slots_of=None):  # fmt: skip
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: want one of {', '.join(ROUTINGS)}")
        self.cooldown_s = cooldown_s
        self.routing = routing
        self.prefix = (prefix or PrefixIndex()) if routing == "prefix" else None
        # A replica's slots, for the load guard: the engine's word, else the config's.
        self.slots_of = slots_of or (lambda ep: ep.signal.slots if ep.signal else 0)
        # Whether the table can answer for models: it has static endpoints, or no feed
        # is coming (`fed`: the schedulers will send it), or the feed's first table came.
        # Until then a model it does not list may well exist: never say it does not.
        self.has_table = bool(endpoints) or not fed
        self._table_waiters: list = []
        self._by_model: dict[str, list[Endpoint]] = {}
        self._by_id: dict[str, Endpoint] = {}
        self._known: dict[str, tuple[str, str]] = {}
        self._waiters: dict[str, list] = {}  # model -> futures of requests waiting for it
        self._turn = 0
        self.replace(list(endpoints))

    def replace(self, endpoints: list[Endpoint], known: dict | None = None) -> None:
        """Install a new set of endpoints, keeping the counters of ones that stay.

        `known` maps the catalog's models and aliases, served or not, to the scheduler's
        (state, reason) for them, so a request for one that is starting is told to wait,
        and one for a model that will not come up is told why at once.
        """
        by_id = {}
        for ep in endpoints:
            old = self._by_id.get(ep.id)
            if old is not None and old is not ep and old.url == ep.url:
                # The endpoint that stays is the same object, its counters, cooldown,
                # signal and last use with it. Copying the counter onto a new object
                # left each request in flight at a table change counted forever: it
                # ended on the old one. Under load the autoscaler then saw an idle
                # replica busy and never scaled down (tests/system/test_autoscale.py).
                # Dropping last_used, before, lost a request that ended just before a
                # snapshot: the scheduler never heard the replica was used.
                old.models, old.key, old.head = ep.models, ep.key, ep.head
                old.engine = ep.engine
                ep = old
            by_id[ep.id] = ep
        by_model: dict[str, list[Endpoint]] = {}
        for ep in by_id.values():
            for model in ep.models:
                by_model.setdefault(model, []).append(ep)
        self._by_id, self._by_model = by_id, by_model
        if self.prefix is not None:
            self.prefix.forget(by_id)
        self._known = dict(known or {})
        if known is not None and not self.has_table:  # the feed's first table
            self.has_table = True
            for fut in self._table_waiters:
                if not fut.done():
                    fut.set_result(True)
            self._table_waiters = []
        # Every table wakes every waiter: served, or to look at what the table says now.
        self.wake_waiters()

    def wake_waiters(self) -> None:
        """Have every request waiting for a model look again: served now, or whether its
        `given_up()` says to stop (say, the schedulers have gone silent)."""
        for model in list(self._waiters):
            for fut in self._waiters.pop(model):
                if not fut.done():
                    fut.set_result(model in self._by_model)

    async def wait_served(self, model: str, timeout: float, given_up=None) -> bool:
        """Wait (on the event loop) until `model` has an endpoint; False at the deadline,
        or as soon as `given_up()` (checked on each new table) says to stop waiting."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                while model not in self._by_model:
                    if given_up is not None and given_up():
                        return False
                    fut = loop.create_future()
                    self._waiters.setdefault(model, []).append(fut)
                    try:
                        await fut
                    finally:
                        waiting = self._waiters.get(model)
                        if waiting and fut in waiting:
                            waiting.remove(fut)
                return True
        except TimeoutError:
            return False

    async def wait_table(self, timeout: float) -> bool:
        """Wait (on the event loop) for the feed's first table; False at the deadline."""
        if self.has_table:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._table_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            return False
        finally:
            if fut in self._table_waiters:
                self._table_waiters.remove(fut)

    def knows(self, model: str) -> bool:
        return model in self._known or model in self._by_model

    def status(self, model: str) -> tuple[str, str] | None:
        """The scheduler's (state, reason) for a catalog model, None for an unknown one."""
        return self._known.get(model)

    def waited_for(self) -> list[str]:
        """Models that requests are waiting on now (read from the feed's thread: a copy
        of the keys is one C call, safe against the event loop changing the dict)."""
        return [m for m, futs in list(self._waiters.items()) if futs]

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def endpoints(self) -> list[Endpoint]:
        return list(self._by_id.values())

    def endpoints_of(self, model: str) -> list[Endpoint]:
        return self._by_model.get(model) or []

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def key(self, payload: dict, session: str = "") -> Key | None:
        """The request's prefix key when routing by prefix (else None: no work)."""
        if self.prefix is None:
            return None
        return request_key(payload, session, self.prefix.block_chars)

    def pick(self, model: str, now: float, exclude=(), key: Key | None = None) -> Endpoint | None:
        """The endpoint to try next, or None when every one is excluded or cooling down.

        Least-outstanding counts this router's requests in flight and other routers' as
        each engine said at its last probe. Ties go round-robin, so light traffic still
        spreads over every endpoint. With a
        prefix `key`, the choice is the prefix index's; each pick with a key must be
        followed by `served()` with it. Under prefix routing a request with no prompt
        to key on (embeddings) goes to the least outstanding.
        """
        eps = self._by_model.get(model)
        if not eps:
            return None
        n = len(eps)
        self._turn += 1
        if self.routing == "round-robin" or (key is not None and self.prefix is not None):
            live = [
                eps[(self._turn + i) % n]
                for i in range(n)
                if eps[(self._turn + i) % n].cooldown_until <= now
                and eps[(self._turn + i) % n] not in exclude
            ]
            if not live:
                return None
            if self.routing == "round-robin":
                return live[0]
            for ep in live:
                sig = ep.signal
                if sig is not None and getattr(sig, "ctx", 0):
                    self.prefix.size(ep.id, sig.ctx, model)
            return self.prefix.choose(live, key, self.slots_of, _others(time.time()))
        # Its own requests in flight on each, and other routers' as the engine said lately
        # (a second router must not pile onto an engine the first keeps busy).
        others = _others(time.time())
        best, least = None, 0
        for i in range(n):
            ep = eps[(self._turn + i) % n]
            if ep.cooldown_until > now or ep in exclude:
                continue
            load = ep.outstanding + (others(ep) if ep.signal is not None else 0)
            if best is None or load < least:
                best, least = ep, load
        return best

    def served(self, ep: Endpoint, key: Key, prompt_tokens: int, cached: int | None,
               decode_weight: float | None = None) -> Outcome:  # fmt: skip
        """The request picked with `key` ended: what the index predicted and learned."""
        return self.prefix.served(ep.id, key, prompt_tokens, cached, decode_weight)

    def retry_after(self, model: str, now: float) -> float:
        """Seconds until the first endpoint of `model` comes out of cooldown."""
        eps = self._by_model.get(model) or ()
        return max(0.0, min((ep.cooldown_until - now for ep in eps), default=0.0))

    def failed(self, ep: Endpoint, now: float) -> None:
        ep.cooldown_until = now + self.cooldown_s
