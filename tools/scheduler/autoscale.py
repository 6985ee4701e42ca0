"""Autoscaling in the pass: each model's desired count from its load (the pure decision
in `llmgw.scaling`), the replica a scale-down gives back, and scale-ups that fit nowhere.

A change is said once: a log event, a line in the audit log (actor `scheduler`) and the
decisions counter; what the model wants now and why is in `llmgw models` and the admin
API. On-demand models (min 0) are left to demand.py.
"""

from llmgw import audit, log, scaling
from llmgw.catalog import Model
from llmgw.states import ShardState
from llmgw.store import drop_connection
from llmgw_scheduler.load import Loads

_log = log.get("llmgw.scheduler")


class Autoscaler:
    def __init__(self, catalog, inv, loads: Loads, clock):
        self.catalog = catalog
        self.inv = inv
        self.loads = loads
        self.clock = clock
        self.states: dict[str, scaling.State] = {}
        self.blocked: dict[str, str] = {}  # model -> why a wanted replica fits nowhere
        self.decisions: dict[str, int] = {scaling.UP: 0, scaling.DOWN: 0}  # for metrics

    def scales(self, m: Model) -> bool:
        return m.min > 0

    def desired(self, m: Model) -> int:
        """The replicas `m` should have now, for a model with min > 0 (its min until a
        pass has decided)."""
        st = self.states.get(m.name)
        return max(m.min, min(m.max, st.desired)) if st else m.min

    def reason(self, model: str) -> str:
        st = self.states.get(model)
        return st.reason if st else ""

    def pass_(self, counted: dict[str, list], now: float) -> None:
        """Decide every scaling model's count; `counted` is model -> the replicas that
        count for it (live, not on a draining node)."""
        self.loads.forget_stale(now)
        for m in self.catalog.models.values():
            if not self.scales(m):
                self.states.pop(m.name, None)
                continue
            mine = counted.get(m.name, [])
            prev = self.states.get(m.name)
            if prev is None:
                prev = scaling.initial(m.scaling(), len(mine))
            ready = [r.id for r in mine if r.state == ShardState.READY]
            load = self.loads.load((m.name, *m.aliases), ready, now) if ready else None
            st = self.states[m.name] = scaling.decide(m.scaling(), load, prev, now)
            if st.desired != prev.desired:
                self._said(m, prev.desired, st)

    def _said(self, m: Model, was: int, st: scaling.State) -> None:
        self.decisions[st.direction] = self.decisions.get(st.direction, 0) + 1
        _log.info("model_autoscaled", model=m.name, desired=st.desired, was=was,
                  direction=st.direction, reason=st.reason)  # fmt: skip
        try:
            audit.record(f"models.scale_{st.direction}", "scheduler", "", m.name,
                         now=self.clock(), desired=st.desired, was=was,
                         reason=st.reason)  # fmt: skip
        except Exception as e:
            _log.error("audit_write_failed", action="models.autoscale", target=m.name,
                       reason=str(e)[:200])  # fmt: skip
            drop_connection()

    def to_give_back(self, counted: dict[str, list], skip=frozenset()) -> list[str]:
        """One replica per model that has more ready replicas than it wants, when none is
        starting: the least loaded (fewest requests in flight, then idle longest), so the
        fewest requests wait on a stopping engine.
        Stopping it lets the engine finish what it has, as a drain does. Models in `skip`
        (being restarted: a surge replica is not a surplus) are left alone."""
        out = []
        for name, mine in counted.items():
            m = self.catalog.models.get(name)
            if m is None or not self.scales(m) or name not in self.states or name in skip:
                continue
            if len(mine) <= self.desired(m) or any(r.state != ShardState.READY for r in mine):
                continue
            now = self.clock()
            least = min(mine, key=lambda r: (self.loads.inflight(r.id, now), r.last_used,
                                             -r.created))  # fmt: skip
            out.append(least.id)
        return out

    def report_blocked(self, unplaceable: dict[str, dict[str, str]], needs, nodes) -> None:
        """A wanted replica of a serving model that fits nowhere: blocked, with why."""
        blocked = {}
        for name, reasons in unplaceable.items():
            m = self.catalog.models.get(name)
            if m is None or not self.scales(m) or self.desired(m) <= m.min:
                continue
            need = needs.need(m).memory
            free = max((n.memory_free for n in nodes if not n.lost and not n.draining),
                       default=0)  # fmt: skip
            if need > free:
                why = f"needs {need / 2**30:.1f} GiB, largest free {free / 2**30:.1f}"
            else:
                why = "; ".join(f"{n}: {w}" for n, w in sorted(reasons.items())) or "no nodes"
            blocked[name] = f"cannot scale up: {why}"
        for name, why in blocked.items():
            if self.blocked.get(name) != why:
                _log.warning("scale_up_blocked", model=name, reason=why)
        self.blocked = blocked
