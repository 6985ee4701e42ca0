"""Limits and budgets at the door: reserve what a request may use before it is sent,
answer 429 (or 503) in OpenAI's shape when it may not, correct the reservation when it
ends, and say where the caller stands in `x-ratelimit-*` headers.
"""

import asyncio
import math
import time

from llmgw_router import metrics
from llmgw_router.errors import ApiError
from llmgw_router.leases import Leaser
from llmgw_router.limits import (
    BUDGET_KINDS,
    COST_KINDS,
    Limiter,
    Reservation,
    Shortfall,
    cost_units,
    estimate_prompt_tokens,
)
from llmgw_router.policy import Policy

_WHAT = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "concurrent": "concurrent requests",
    "tokens/day": "tokens per day",
    "tokens/month": "tokens per month",
    "cost/day": "cost per day",
    "cost/month": "cost per month",
}


_REQUESTS = tuple(f"x-ratelimit-{w}-requests" for w in ("limit", "remaining", "reset"))
_TOKENS = tuple(f"x-ratelimit-{w}-tokens" for w in ("limit", "remaining", "reset"))


class Ask:
    """What one request asks of its limits: the amount each kind of counter takes."""

    __slots__ = ("prompt", "completion", "entries", "amounts")

    def __init__(self, prompt: int, completion: int, entries: tuple, amounts: tuple):
        self.prompt, self.completion = prompt, completion
        self.entries, self.amounts = entries, amounts


class Quota:
    def __init__(self, limiter: Limiter, leaser: Leaser | None, wait_s: float,
                 default_max_tokens: int):  # fmt: skip
        self.limiter = limiter
        self.leaser = leaser
        self.wait_s = wait_s
        self.default_max_tokens = default_max_tokens

    def ask(self, policy: Policy, body_len: int, max_tokens: int, prices) -> Ask:
        """The amounts to reserve: 1 request (rpm, concurrent); the prompt's estimate
        plus max_tokens (tpm); and for budgets, which must never be overspent, the
        prompt's upper bound (a token is at least a byte of the body) plus max_tokens,
        or its price."""
        prompt = estimate_prompt_tokens(body_len)
        units = cost_units(body_len, max_tokens, *prices) if prices and policy.costs else 0
        amounts = (1, prompt + max_tokens, body_len + max_tokens, units)
        return Ask(prompt, max_tokens, policy.entries, amounts)

    def try_reserve(self, ask: Ask):
        """A Reservation from what this router holds now, or the Shortfall that stopped
        it (then `reserve` waits for a lease)."""
        return self.limiter.admit(ask.entries, ask.amounts, time.time())

    async def reserve(self, ask: Ask, r=None):
        """A Reservation, or the Shortfall that stopped it: wait (up to `wait_s` in all)
        for the lease thread while this router's share has run out."""
        lim = self.limiter
        if r is None:
            r = lim.admit(ask.entries, ask.amounts, time.time())
        if isinstance(r, Reservation) or not r.wait or self.leaser is None:
            return r
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while True:
            fut = loop.create_future()
            lim.add_waiter(r.counter, fut, r.amount)
            self.leaser.wake()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await fut
            except TimeoutError:
                return r
            r = lim.admit(ask.entries, ask.amounts, time.time())
            if isinstance(r, Reservation) or not r.wait or loop.time() >= deadline:
                return r

    async def regrade(self, r: Reservation, ask: Ask, body_len: int, old, new):
        """Before a fallback answers at other prices: reserve what more its prices cost
        from cost budgets (waiting for a lease as `reserve` does). The prices the
        reservation now covers, or None if it does not fit (the fallback is skipped)."""
        costs = [c for c, *_ in r.takes if c.kind in COST_KINDS]
        if not new or new == old or not costs:
            return old
        before = cost_units(body_len, ask.completion, *old) if old else 0
        extra = cost_units(body_len, ask.completion, *new) - before
        if extra <= 0:
            return old
        lim, loop = self.limiter, asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while not lim.top_up(r, COST_KINDS, extra, time.time()):
            now = time.time()
            short = [c for c in costs if c.local < extra]
            if (self.leaser is None or loop.time() >= deadline
                    or any(now < c.exhausted_until or extra > c.limit for c in short)):  # fmt: skip
                return None
            fut = loop.create_future()
            for c in short:
                lim.add_waiter(c, fut, c.local + extra if c.local > 0 else extra)
            self.leaser.wake()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await fut
            except TimeoutError:
                return None
        return new

    def settle(self, r: Reservation, prompt: int, completion: int, prices) -> int:
        """Correct the reservation to what was used; the request's cost units."""
        units = cost_units(prompt, completion, *prices) if prices else 0
        self.limiter.settle(r, prompt + completion, units, time.time())
        return units

    @staticmethod
    def headers(policy: Policy) -> dict:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens} of the tightest (the
        smallest) rpm and tpm limits that apply; none when none do."""
        out = {}
        now = time.time()
        for unit, c in policy.heads:
            names = _REQUESTS if unit == "requests" else _TOKENS
            left = c.limit - c.fleet + c.local
            out[names[0]] = str(c.limit)
            out[names[1]] = str(left if left > 0 else 0)
            out[names[2]] = f"{math.ceil(c.ends - now) if c.ends > now else 0}s"
        return out

    @staticmethod
    def refusal(short: Shortfall, headers: dict) -> ApiError:
        """429 for a limit or budget, 503 when more could not be leased from the store."""
        c = short.counter
        scope, subject = c.name.split(":", 2)[1:]
        what = f"{_WHAT[c.kind]} on {scope} '{subject}'"
        if c.failed:
            metrics.LIMITS_UNAVAILABLE.inc()
            return ApiError(
                503,
                f"The allowance for {what} cannot be checked right now (the store is"
                " unreachable); try again shortly.",
                "server_error",
                "limits_unavailable",
                retry_after=2,
                headers=headers,
            )
        elif c.kind in BUDGET_KINDS:
            metrics.BUDGET_REJECTIONS.labels(c.kind).inc()
            return ApiError(
                429,
                f"The budget for {what} is spent (limit {_amount(c, c.limit)}); it renews"
                f" in {math.ceil(c.reset_in(time.time()))}s.",
                "insufficient_quota",
                "insufficient_quota",
                retry=False,
                headers=headers,
            )
        else:
            metrics.LIMITED.labels(c.kind).inc()
            wait = max(1, math.ceil(c.reset_in(time.time()))) if c.period else 1
            too_big = short.amount > c.limit
            message = (
                f"This request needs {short.amount} of {what}, more than the limit ({c.limit})."
                if too_big
                else f"Rate limit reached for {what} (limit {c.limit}); try again in {wait}s."
            )
            return ApiError(429, message, "requests" if c.kind != "tpm" else "tokens",
                            "rate_limit_exceeded", retry_after=wait,
                            retry=False if too_big else None, headers=headers)  # fmt: skip


def _amount(c, value: int) -> str:
    return f"{value / 1_000_000:g}" if c.kind.startswith("cost") else str(value)
