"""Which on-demand models are in use: routers' wants and activity reports, and the
answers a pass gives to each router's numbered want."""

from llmgw.catalog import Model
from llmgw.placement import Need
from llmgw.reconciler import Desired


class Demand:
    def __init__(self):
        self.last_active: dict[str, float] = {}  # model -> when a router last used it
        # model -> when it was evicted: only requests after that make it active again
        self.evicted_at: dict[str, float] = {}
        # On-demand wants, numbered by each router: (model, router) -> the newest want
        # not yet answered by a pass, and model -> router -> the newest answered. A router
        # waits for the answer to its own want, never on an older one (room may have been
        # made since), and an answer of "unplaceable" is given at once, not after 60 s.
        self.pending: dict[tuple[str, str], int] = {}
        self.answered: dict[str, dict[str, int]] = {}

    def want(self, model: str, router: str, n, now: float) -> None:
        self.last_active[model] = now
        if isinstance(n, int) and not isinstance(n, bool):
            key = (model, router)
            self.pending[key] = max(n, self.pending.get(key, 0))

    def used(self, model: str, idle_s: float, now: float) -> None:
        """A router last used `model` `idle_s` ago (a request before its eviction does
        not make it active again)."""
        used = now - idle_s
        if used > self.evicted_at.get(model, float("-inf")):
            self.last_active[model] = max(self.last_active.get(model, 0.0), used)

    def evicted(self, model: str, now: float) -> None:
        self.last_active[model] = float("-inf")
        self.evicted_at[model] = now

    def take_asked(self) -> dict[tuple[str, str], int]:
        """The wants this pass answers."""
        asked, self.pending = self.pending, {}
        return asked

    def answer(self, asked: dict[tuple[str, str], int]) -> bool:
        """Record this pass's answers; True if there were any (the table changes)."""
        for (model, router), n in asked.items():
            mine = self.answered.setdefault(model, {})
            mine[router] = max(n, mine.get(router, 0))
        return bool(asked)

    def active(self, m: Model, now: float) -> bool:
        """An on-demand model is active from a request until keep_alive_s after the last."""
        return now - self.last_active.get(m.name, float("-inf")) < m.keep_alive_s

    def desired_now(self, m: Model, now: float) -> int:
        """The replicas `m` should have now: its min, or 1 for an on-demand one in use."""
        return m.min if m.min > 0 else int(self.active(m, now))

    def desired(self, m: Model, need: Need, now: float) -> Desired:
        if m.min > 0:
            return Desired(m.name, m.min, m.max, need)
        if self.active(m, now):
            return Desired(m.name, 1, m.max, need)
        return Desired(m.name, 0, 0, need)  # idle: stop what runs
