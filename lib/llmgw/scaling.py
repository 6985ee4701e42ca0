"""How many replicas a model should have now: the autoscaler's decision.

Pure: the model's settings, its load as routers report it (aggregated), the previous
state and the time go in; the new state comes out, with the desired count and why.

Rules:
- Up by one when the model has been saturated (every replica busy, or the queue wait
  p90 over `target_queue_wait_s`) for `up_after_s` without a break.
- Down by one when utilisation (requests in flight over slots) has stayed below
  `down_below` for `down_after_s` without a break.
- Never below min or above max; nothing changes for `cooldown_s` after a change.
- Hysteresis: each window starts again whenever its condition breaks, and the band
  between `down_below` and saturation holds the count, so load hovering near either
  threshold changes nothing.
- A scale-down never leaves the others more than DOWN_HEADROOM used (what runs now
  spread over one replica fewer), so giving one back cannot itself saturate the model
  and bring it straight back, whatever `down_below` is.
- No load reported (no router heard from lately): hold, and both windows start again.
- On-demand models (min 0) are not scaled here: demand.py starts and stops them.
"""

import time
from dataclasses import dataclass

UP, DOWN = "up", "down"
DOWN_HEADROOM = 0.8


@dataclass(frozen=True)
class Settings:
    min: int
    max: int
    target_queue_wait_s: float = 5.0
    up_after_s: float = 30.0
    down_below: float = 0.3
    down_after_s: float = 300.0
    cooldown_s: float = 120.0


@dataclass(frozen=True)
class Load:
    """A model's load, summed over routers: ready replicas seen, how many had every
    slot busy, requests in flight and slots, and the worst queue wait p90."""

    replicas: int = 0
    busy: int = 0
    inflight: int = 0
    slots: int = 0
    queue_wait_p90_s: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.inflight / self.slots if self.slots else 0.0

    def utilisation_with_one_fewer(self) -> float:
        if self.replicas < 2:
            return float("inf")
        return self.inflight / (self.slots - self.slots / self.replicas)


@dataclass(frozen=True)
class State:
    desired: int
    reason: str = ""
    saturated_since: float | None = None
    idle_since: float | None = None
    changed_at: float | None = None
    direction: str = ""  # of the newest change: up, down or "" (none yet)


def initial(s: Settings, running: int) -> State:
    """A scheduler that starts keeps what runs (within min and max): a restart must not
    stop the replicas an earlier scale-up started."""
    return State(desired=max(s.min, min(s.max, running)), reason="")


def saturation(s: Settings, load: Load) -> str:
    """Why the model is saturated, or "" if it is not."""
    if load.replicas and load.busy >= load.replicas:
        return f"{load.busy} of {load.replicas} replicas saturated"
    if load.queue_wait_p90_s > s.target_queue_wait_s:
        return (f"queue wait p90 {load.queue_wait_p90_s:.1f} s over "
                f"{s.target_queue_wait_s:g} s target")  # fmt: skip
    return ""


def decide(s: Settings, load: Load | None, prev: State, now: float) -> State:
    """The next state; `desired` differs from `prev.desired` by at most one."""
    desired = max(s.min, min(s.max, prev.desired))
    if s.min == 0:  # on demand: demand.py decides, from and to zero
        return State(desired=prev.desired, reason=prev.reason)
    if desired != prev.desired:  # min or max changed (`llmgw scale`): follow at once
        return State(desired, f"bounds {s.min}..{s.max}", changed_at=now,
                     direction=UP if desired > prev.desired else DOWN)  # fmt: skip
    if load is None or load.slots == 0:
        return State(desired, prev.reason, changed_at=prev.changed_at, direction=prev.direction)
    why_up = saturation(s, load)
    low = (load.utilisation < s.down_below and not why_up
           and load.utilisation_with_one_fewer() <= DOWN_HEADROOM)  # fmt: skip
    sat_since = _since(prev.saturated_since, now) if why_up else None
    idle_since = _since(prev.idle_since, now) if low else None
    keep = State(desired, prev.reason, sat_since, idle_since, prev.changed_at, prev.direction)
    if prev.changed_at is not None and now - prev.changed_at < s.cooldown_s:
        return keep
    if why_up and now - sat_since >= s.up_after_s and desired < s.max:
        held = now - sat_since
        return State(desired + 1, f"scaled up {_hhmm(now)}: {why_up} {held:.0f} s",
                     changed_at=now, direction=UP)  # fmt: skip
    if low and now - idle_since >= s.down_after_s and desired > s.min:
        held = now - idle_since
        return State(desired - 1,
                     f"scaled down {_hhmm(now)}: utilisation {load.utilisation:.0%} below "
                     f"{s.down_below:.0%} {held:.0f} s",
                     changed_at=now, direction=DOWN)  # fmt: skip
    return keep


def _since(before: float | None, now: float) -> float:
    return now if before is None else before


def _hhmm(now: float) -> str:
    return time.strftime("%H:%M", time.gmtime(now))
