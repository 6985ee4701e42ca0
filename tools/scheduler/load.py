"""Each model's load as the routers report it, summed over routers for the autoscaler.

Every router sends, with its activity report (every 2 s), requests in flight and slots
per replica and each model's queue wait p90. A router that stops reporting (gone, or cut
off) is forgotten after STALE_S, so its last word, busy or idle, does not hold a model
up or down.
"""

from llmgw.scaling import Load

STALE_S = 10.0  # five activity reports missed


class Loads:
    def __init__(self):
        # router -> (when, replica id -> [in flight, slots], model -> queue wait p90)
        self.reports: dict[str, tuple[float, dict, dict]] = {}

    def report(self, router: str, body: dict, now: float) -> None:
        replicas = body.get("replica_load")
        waits = body.get("queue_wait_p90_s")
        if not isinstance(replicas, dict) and not isinstance(waits, dict):
            return  # a router from before autoscaling: it says nothing about load
        clean = {}
        for rid, pair in (replicas or {}).items():
            if isinstance(pair, list) and len(pair) == 2 and all(_num(x) for x in pair):
                clean[rid] = (max(0, pair[0]), max(0, pair[1]))
        p90 = {m: float(w) for m, w in (waits or {}).items() if _num(w)}
        self.reports[router] = (now, clean, p90)

    def load(self, names: tuple[str, ...], replicas: list[str], now: float) -> Load | None:
        """The load on the model called `names` (its name and aliases) served by the
        ready `replicas`; None if no router has reported lately."""
        fresh = [(r, w) for t, r, w in self.reports.values() if now - t <= STALE_S]
        if not fresh:
            return None
        inflight: dict[str, float] = {}
        slots: dict[str, float] = {}
        p90 = 0.0
        for by_replica, waits in fresh:
            for rid in replicas:
                if rid in by_replica:
                    n, s = by_replica[rid]
                    inflight[rid] = inflight.get(rid, 0) + n
                    slots[rid] = max(slots.get(rid, 0), s)
            p90 = max([p90, *(waits.get(n, 0.0) for n in names)])
        seen = [rid for rid in replicas if slots.get(rid)]
        return Load(
            replicas=len(seen),
            busy=sum(1 for rid in seen if inflight[rid] >= slots[rid]),
            inflight=int(sum(inflight.get(rid, 0) for rid in seen)),
            slots=int(sum(slots[rid] for rid in seen)),
            queue_wait_p90_s=p90,
        )

    def inflight(self, rid: str, now: float) -> int:
        """Requests in flight on replica `rid`, summed over routers reporting lately."""
        return sum(r[rid][0] for t, r, _ in self.reports.values()
                   if now - t <= STALE_S and rid in r)  # fmt: skip

    def forget_stale(self, now: float) -> None:
        for router in [k for k, (t, _, _) in self.reports.items() if now - t > STALE_S]:
            del self.reports[router]


def _num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
