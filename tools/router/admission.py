"""Admission by priority band: while a model's replicas are saturated, requests wait in
one queue per band, and a freed slot goes to the head of the highest band waiting.

A model is saturated when the requests this router has in flight on it reach its
slots: every ready endpoint not in cooldown times its slots per replica (the catalog's
`profile.parallel`, else `router.slots_per_replica`; 0: unknown, never saturated).
An idle model takes the fast path: one comparison, no queue. Everything here runs on
the event loop; nothing waits on the store.
"""

import asyncio
import collections
import time

from llmgw_router import metrics

# Queue waits the p90 is taken over: the last minute, at most this many per model.
WAITS_S = 60.0
WAITS_KEPT = 1000


class Admission:
    def __init__(self, bands: list[str], capacity, clock=time.monotonic):
        self.bands = list(bands) or ["default"]
        self.capacity = capacity  # model -> slots now (None: unlimited)
        self.clock = clock
        self.inflight: dict[str, int] = {}
        self.queues: dict[str, list[collections.deque]] = {}
        self.waiting: dict[str, int] = {}  # model -> queued requests
        # model -> (when, seconds) of each queued request's wait, for the scheduler's
        # autoscaler: the p90 over the last WAITS_S (feed.py reports it).
        self.waits: dict[str, collections.deque] = {}

    def enter_now(self, model: str) -> bool:
        """Admit at once if nothing is queued and there is a free slot."""
        if self.waiting.get(model):
            return False
        cap = self.capacity(model)
        n = self.inflight.get(model, 0)
        if cap is not None and n >= cap:
            return False
        self.inflight[model] = n + 1
        return True

    async def enter(self, model: str, band: int, deadline_s: float) -> bool:
        """Wait for a slot up to `deadline_s`; False when the deadline passed first."""
        if self.enter_now(model):
            return True
        if deadline_s <= 0:
            self._rejected(band)
            return False
        fut = asyncio.get_running_loop().create_future()
        queues = self.queues.get(model)
        if queues is None:
            queues = self.queues[model] = [collections.deque() for _ in self.bands]
        queue = queues[min(band, len(queues) - 1)]
        queue.append(fut)
        self.waiting[model] = self.waiting.get(model, 0) + 1
        name = self.bands[min(band, len(self.bands) - 1)]
        metrics.QUEUE_DEPTH.labels(model, name).inc()
        t0 = self.clock()
        done = False
        try:
            async with asyncio.timeout(deadline_s):
                await fut
            done = True
        except TimeoutError:
            done = True
        finally:
            metrics.QUEUE_DEPTH.labels(model, name).dec()
            end = self.clock()
            metrics.QUEUE_WAIT.labels(name).observe(end - t0)
            self.waits.setdefault(model, collections.deque(maxlen=WAITS_KEPT)).append(
                (end, end - t0)
            )
            granted = fut.done() and not fut.cancelled()
            if not granted:
                fut.cancel()
                if fut in queue:
                    queue.remove(fut)
                    self.waiting[model] -= 1
            elif not done:
                self.leave(model)  # granted, but the client left: pass the slot on
        if granted:
            return True
        self._rejected(band)
        return False

    def _rejected(self, band: int) -> None:
        metrics.QUEUE_REJECTIONS.labels(self.bands[min(band, len(self.bands) - 1)]).inc()

    def leave(self, model: str) -> None:
        """A request admitted on `model` is done: hand its slot to the next in line."""
        self.inflight[model] = self.inflight.get(model, 1) - 1
        if self.waiting.get(model):
            self.pump(model)

    def pump(self, model: str) -> None:
        """Admit waiting requests, highest band first, while there are free slots."""
        queues = self.queues.get(model)
        if not queues:
            return
        cap = self.capacity(model)
        for queue in queues:
            while queue and (cap is None or self.inflight.get(model, 0) < cap):
                fut = queue.popleft()
                self.waiting[model] -= 1
                if fut.done():
                    continue
                self.inflight[model] = self.inflight.get(model, 0) + 1
                fut.set_result(True)
            if queue:
                return

    def pump_all(self) -> None:
        """After the routing table or cooldowns changed: capacity may have grown."""
        for model, n in list(self.waiting.items()):
            if n:
                self.pump(model)

    def depth(self, model: str) -> int:
        return self.waiting.get(model, 0)

    def wait_p90(self, now: float) -> dict[str, float]:
        """Per model, the 90th percentile of queue waits that ended in the last WAITS_S
        (models with none are left out). Read from the feed's thread: it copies."""
        out = {}
        for model, waits in list(self.waits.items()):
            recent = sorted(w for t, w in list(waits) if now - t <= WAITS_S)
            if recent:
                out[model] = round(recent[min(len(recent) - 1, int(0.9 * len(recent)))], 3)
        return out
