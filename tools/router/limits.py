"""Limits and budgets as one router counts them: its share of the fleet's allowance.

Pure bookkeeping, no I/O, the time passed in. Each limit (rpm, tpm, concurrent) and
budget (tokens or cost, per day or month) on a key, user, project, team or org is one
Counter. A router may only admit what it has leased from the store (leases.py does
that from a background thread), so the fleet together can never admit more than the
limit; see docs/limits.md for the mechanism and its bounds.

A request reserves from every counter that applies: 1 request (rpm, concurrent), its
estimated prompt plus max_tokens (tpm, token budgets), or their price (cost budgets).
When it ends the reservation is corrected to what it used. All of it is in memory,
under one lock shared with the lease thread, never held across I/O.
"""

import math
import threading

from llmgw import periods

# kind -> the window it counts in (None: concurrent, which is not windowed).
PERIOD = {
    "rpm": "minute",
    "tpm": "minute",
    "concurrent": None,
    "tokens/day": "day",
    "tokens/month": "month",
    "cost/day": "day",
    "cost/month": "month",
}
TOKEN_KINDS = frozenset(("tpm", "tokens/day", "tokens/month"))
COST_KINDS = frozenset(("cost/day", "cost/month"))
BUDGET_KINDS = frozenset(("tokens/day", "tokens/month", "cost/day", "cost/month"))
# A cost is counted in millionths of the price unit, so counters stay integers.
COST_SCALE = 1_000_000
# A concurrency counter whose hold the store could not renew is trusted this much less
# long than the hold lasts, so no other router can have been given its slots.
HOLD_MARGIN_S = 5.0


class Counter:
    """One limit or budget, from this router's side: what it may still admit."""

    __slots__ = (
        "name", "kind", "period", "limit", "window", "ends", "local", "fleet",
        "exhausted_until", "failed", "in_use", "valid_until", "used", "rate", "last_used",
        "waiters", "need", "settles", "costs",
    )  # fmt: skip

    def __init__(self, name: str, kind: str, limit: int):
        self.name = name  # as the store counts it: "rpm:user:ada"
        self.kind = kind
        self.period = PERIOD[kind]
        self.limit = limit
        self.window = 0  # the window `local` belongs to (its start)
        self.ends = 0
        self.local = 0  # leased and not yet reserved (concurrent: slots held, not in use)
        self.fleet = 0  # what the whole fleet had leased at our last lease (for headers)
        self.exhausted_until = 0.0  # the store had no more to give; ask again after this
        self.failed = False  # the last lease attempt could not reach the store
        self.in_use = 0  # concurrent: slots in use
        self.valid_until = math.inf  # concurrent: our hold is surely ours until then
        self.used = 0  # units reserved since the lease thread last looked (its rate)
        self.rate = 0.0  # units per second, smoothed, kept by the lease thread
        self.last_used = 0.0
        self.waiters: list = []  # futures of requests waiting for a lease
        self.need = 0  # the largest amount a waiter needs
        self.settles = kind != "rpm"  # corrected when a request ends (rpm: a request is 1)
        self.costs = kind in COST_KINDS

    def roll(self, now: float) -> None:
        """Move to the window holding `now`; what was left of the old one is gone."""
        if self.period is not None and now >= self.ends:
            self.window, self.ends = periods.window(self.period, now)
            self.local = 0
            self.fleet = 0
            self.exhausted_until = 0.0

    def remaining(self) -> int:
        """What the fleet may still admit in this window, as far as we know."""
        return max(0, self.limit - self.fleet + self.local)

    def reset_in(self, now: float) -> float:
        return max(0.0, self.ends - now) if self.period else 1.0


class Shortfall:
    """Why a reservation was not made: the counter, and whether to wait for a lease."""

    __slots__ = ("counter", "amount", "wait")

    def __init__(self, counter: Counter, amount: int, wait: bool):
        self.counter, self.amount, self.wait = counter, amount, wait


class Reservation:
    """What one request took from each counter, to be corrected when it ends."""

    __slots__ = ("takes", "released")

    def __init__(self, takes: list):
        self.takes = takes  # [(counter, amount, window)]
        self.released = False


class Limiter:
    def __init__(self):
        self.counters: dict[str, Counter] = {}
        self.lock = threading.Lock()

    def counter(self, kind: str, scope: str, subject: str, limit: int) -> Counter:
        """The counter for a limit, made on first use; a changed limit applies at once."""
        name = f"{kind}:{scope}:{subject}"
        c = self.counters.get(name)
        if c is None:
            with self.lock:
                c = self.counters.setdefault(name, Counter(name, kind, limit))
        c.limit = limit
        return c

    def reserve(self, takes: list, now: float):
        """Take `amount` from every counter of `takes` [(counter, amount)], or nothing."""
        entries = [(c, i) for i, (c, _) in enumerate(takes)]
        return self.admit(entries, [a for _, a in takes], now)

    def admit(self, entries, amounts, now: float):
        """Take from every counter of `entries` [(counter, i)] the amount `amounts[i]`,
        or nothing: a Reservation, or a Shortfall naming the first that cannot give it.
        One pass, undone in the rare case a counter falls short: this runs on every
        limited request."""
        taken = []  # what `settle` corrects: every counter but rpm
        with self.lock:
            for n, (c, i) in enumerate(entries):
                amount = amounts[i]
                if c.period is None:
                    if c.local < amount or now >= c.valid_until:
                        return self._refuse(entries, amounts, n, now)
                    c.in_use += amount
                else:
                    if now >= c.ends:
                        c.roll(now)
                    if c.local < amount:
                        return self._refuse(entries, amounts, n, now)
                c.local -= amount
                c.used += amount
                if c.settles:
                    taken.append((c, amount, c.window))
            return Reservation(taken)

    def _refuse(self, entries, amounts, upto: int, now: float) -> "Shortfall":
        for c, i in entries[:upto]:  # undo what was taken
            c.local += amounts[i]
            c.used -= amounts[i]
            if c.period is None:
                c.in_use -= amounts[i]
        short = None
        for c, i in entries:
            amount = amounts[i]
            # Asked for, admitted or not: the lease thread keeps (and gets) allowance for
            # counters in use.
            c.last_used = now
            if c.period is not None and now >= c.ends:
                c.roll(now)
            ok = c.local >= amount and (c.period is not None or now < c.valid_until)
            if not ok:
                # A request bigger than the whole limit can never fit: no use waiting for
                # it, nor asking the store again while the fleet has none left.
                wait = now >= c.exhausted_until and amount <= c.limit
                if wait:
                    c.need = max(c.need, amount)
                if short is None:
                    short = Shortfall(c, amount, wait)
        return short

    def settle(self, r: Reservation, tokens: int, cost_units: int, now: float) -> None:
        """Correct a reservation to what the request used: the difference goes back to
        (or, if it used more, is owed by) this window's allowance; slots are freed."""
        if r.released:
            return
        r.released = True
        with self.lock:
            for c, amount, window in r.takes:
                if c.period is None:
                    c.in_use -= amount
                    c.local += amount
                    continue
                actual = cost_units if c.costs else tokens
                if now >= c.ends:
                    c.roll(now)
                if c.window == window:
                    c.local += amount - actual  # negative: a debt the next lease pays
                elif actual > amount:
                    c.local -= actual - amount  # overspent a window that has ended

    def top_up(self, r: Reservation, kinds: frozenset, amount: int, now: float) -> bool:
        """Reserve `amount` more from the counters of `kinds` a reservation holds (a
        fallback with higher prices), from what this router holds now, or nothing."""
        if amount <= 0:
            return True
        with self.lock:
            takes = [i for i, (c, _, window) in enumerate(r.takes) if c.kind in kinds]
            for i in takes:
                c, _, window = r.takes[i]
                c.roll(now)
                if c.window != window or c.local < amount:
                    return False
            for i in takes:
                c, held, window = r.takes[i]
                c.local -= amount
                r.takes[i] = (c, held + amount, window)
            return True

    def add_waiter(self, c: Counter, fut, amount: int) -> None:
        with self.lock:
            c.waiters.append(fut)
            c.need = max(c.need, amount)

    # -- the lease thread's side ---------------------------------------------------------

    def take_waiters(self, c: Counter) -> list:
        with self.lock:
            waiters, c.waiters = c.waiters, []
            return waiters

    def granted(self, c: Counter, window: int, amount: int, fleet: int, full: bool,
                now: float) -> None:  # fmt: skip
        """The store gave `amount` for `window` (fleet: its leased total now); `full`: it
        had less than was asked."""
        with self.lock:
            c.failed = False
            if window == c.window or (now >= c.ends and c.window < window):
                c.roll(now)
                if window != c.window:
                    return  # a window that has ended: the grant is void
                c.local += amount
                c.fleet = fleet
            else:
                return
            if full:
                # Others may return theirs, or the limit be raised: ask again, but not on
                # every request.
                c.exhausted_until = min(c.ends, now + 1.0)

    def held(self, c: Counter, held: int, fleet: int, full: bool, now: float,
             valid_until: float) -> None:  # fmt: skip
        """A concurrency counter's hold is now `held` slots, sure until `valid_until`."""
        with self.lock:
            c.failed = False
            c.local = held - c.in_use  # below 0: more in flight than we hold; admit none
            c.fleet = fleet
            c.valid_until = valid_until
            c.exhausted_until = now + 1.0 if full else 0.0

    def take_back(self, c: Counter, now: float) -> tuple[int, int]:
        """Give up what this router holds and does not use: (amount, window)."""
        with self.lock:
            c.roll(now)
            if c.local <= 0:
                return 0, c.window
            amount, c.local = c.local, 0
            return amount, c.window

    def put_back(self, c: Counter, window: int, amount: int) -> None:
        """A return that failed: the allowance is still ours."""
        with self.lock:
            if window == c.window:
                c.local += amount

    def failed(self, c: Counter) -> None:
        with self.lock:
            c.failed = True


# -- what a request reserves ----------------------------------------------------------


def estimate_prompt_tokens(body_bytes: int) -> int:
    """Prompt tokens, estimated from the request body: about 4 bytes a token in
    English and code, and the body's JSON around the text makes it err high."""
    return body_bytes // 4 + 1


def cost_units(prompt: int, completion: int, input_per_mtok: float, output_per_mtok: float):
    """A request's cost in millionths of the price unit, rounded up."""
    return math.ceil(prompt * input_per_mtok + completion * output_per_mtok)
