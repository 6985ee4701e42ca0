"""Which on-demand models are in use: routers' wants and activity reports, and the
answers a pass gives to each router's numbered want."""

from collections import deque

from llmgw.catalog import Model
from llmgw.placement import Need
from llmgw.reconciler import Desired

# Recent demand (`Demand.rate`) counts uses over this window. A use is a want, or an
# activity report saying the model was used since the last use heard of; uses less than
# USE_GAP_S apart are one (routers report every 2 s, so a busy model counts about one a
# report, not one a request: the rate says how often a model is in use, not how much).
DEMAND_WINDOW_S = 600.0
USE_GAP_S = 1.0


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
        self.uses: dict[str, deque[float]] = {}  # model -> its uses in the window, oldest first

    def want(self, model: str, router: str, n, now: float) -> None:
        self.last_active[model] = now
        self._use(model, now, now)
        if isinstance(n, int) and not isinstance(n, bool):
            key = (model, router)
            self.pending[key] = max(n, self.pending.get(key, 0))

    def used(self, model: str, idle_s: float, now: float) -> None:
        """A router last used `model` `idle_s` ago (a request before its eviction does
        not make it active again)."""
        used = now - idle_s
        if used > self.evicted_at.get(model, float("-inf")):
            self.last_active[model] = max(self.last_active.get(model, 0.0), used)
            self._use(model, used, now)

    def _use(self, model: str, at: float, now: float) -> None:
        uses = self.uses.setdefault(model, deque())
        if uses and at < uses[-1] + USE_GAP_S:
            return  # the same use again (each report repeats it), or one just after it
        uses.append(at)
        self._forget(uses, now)

    def rate(self, model: str, now: float) -> float:
        """Recent demand: uses per minute over the last DEMAND_WINDOW_S."""
        uses = self.uses.get(model)
        if not uses:
            return 0.0
        self._forget(uses, now)
        return len(uses) * 60.0 / DEMAND_WINDOW_S

    @staticmethod
    def _forget(uses: deque, now: float) -> None:
        while uses and uses[0] < now - DEMAND_WINDOW_S:
            uses.popleft()

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
