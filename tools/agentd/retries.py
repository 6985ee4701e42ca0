"""Engine installs that failed, retried with exponential backoff until one succeeds.

A node whose install failed was out for that engine until someone restarted its agent,
although the cause was often passing: the network down while pip fetched, a full disk
freed since, a build cache that arrived later. Each failure waits base × 2^(failures
before it), at most max (agent.install_backoff_base_s, install_backoff_max_s), times
0.5-1.0 so a fleet that failed together (a package index down) does not retry in
lockstep: the scheduler's backoff for failed starts (reconciler.after_failure). Retries
go on at the longest wait until one succeeds; the install stays "failed" meanwhile, so
placement keeps away and the EngineInstallFailed alert can fire, and resolves once the
install succeeds.

No sockets, threads or clocks of its own: the caller passes the time.
"""

import random
from dataclasses import dataclass

from llmgw.reconciler import Backoff, after_failure


@dataclass
class Pending:
    """A failed install of engine NAME-VERSION and when it is tried again."""

    name: str
    version: str
    backoff: Backoff
    running: bool = False  # being retried now


class Retries:
    def __init__(self, base_s: float, max_s: float, rng: random.Random | None = None):
        self.base_s = max(0.0, base_s)
        self.max_s = max(self.base_s, max_s)
        self.rng = rng or random.Random()
        self.pending: dict[str, Pending] = {}  # engine id -> its retry

    def failed(self, name: str, version: str, now: float) -> float:
        """One more failed install of NAME-VERSION: seconds until it is tried again."""
        engine_id = f"{name}-{version}"
        was = self.pending.get(engine_id)
        b = after_failure(was.backoff if was else Backoff(), now, self.rng,
                          self.base_s, self.max_s)  # fmt: skip
        self.pending[engine_id] = Pending(name, version, b)
        return b.next_at - now

    def succeeded(self, engine_id: str) -> None:
        self.pending.pop(engine_id, None)

    def due(self, now: float) -> list[Pending]:
        """The installs whose wait is over, each marked running (taken once)."""
        out = [p for p in self.pending.values() if not p.running and p.backoff.next_at <= now]
        for p in out:
            p.running = True
        return out

    def info(self, engine_id: str, now: float) -> dict:
        """What a failed install's report adds: failures so far and the seconds until it
        is tried again (0: being tried now); {} for one not retried."""
        p = self.pending.get(engine_id)
        if p is None:
            return {}
        wait = 0.0 if p.running else max(0.0, p.backoff.next_at - now)
        return {"attempts": p.backoff.failures, "retry_in_s": round(wait, 1)}
