"""Each model's traffic minute by minute over the last day, for the status page's charts:
requests, errors, time to first token and tokens per second.

The routers' usage rows are the source (one per request: status, tokens, latency, time
to first token), summed per minute and model in the store by `Readings` (readings.py)
and kept here. A minute is replaced whole each time it is read again, so rows a router
wrote late (its spool flushes every second) are counted once they arrive. Only the
catalog's models get series of their own; a request for any other name (a typo, a
model removed) counts under OTHER, so clients cannot grow this without bound: at most
(models + 1) x 1440 minutes.
"""

from dataclasses import dataclass

DAY_S = 86400
OTHER = "(other)"


@dataclass(frozen=True, slots=True)
class Minute:
    """One model's requests in one minute, as summed from the usage rows."""

    requests: int = 0
    client_errors: int = 0  # 4xx: refused (a key, a limit, a bad request)
    errors: int = 0  # 5xx: failed (an engine, no replica)
    ttft_ms_sum: float = 0.0  # over the requests that streamed a first token
    ttft_n: int = 0
    completion_tokens: int = 0

    def __add__(self, o: "Minute") -> "Minute":
        return Minute(
            self.requests + o.requests, self.client_errors + o.client_errors,
            self.errors + o.errors, self.ttft_ms_sum + o.ttft_ms_sum, self.ttft_n + o.ttft_n,
            self.completion_tokens + o.completion_tokens,
        )  # fmt: skip


# What a chart can show of a span of minutes (summed), by name: None where it has no
# meaning (no first token was streamed: no time to first token).
METRICS = {
    "requests": lambda m, s: m.requests / (s / 60),  # per minute
    "errors": lambda m, s: m.errors / (s / 60),
    "client_errors": lambda m, s: m.client_errors / (s / 60),
    "ttft_ms": lambda m, s: m.ttft_ms_sum / m.ttft_n if m.ttft_n else None,
    "tokens_per_s": lambda m, s: m.completion_tokens / s,
}


class Traffic:
    def __init__(self, keep_s: float = DAY_S):
        self.keep_s = keep_s
        self.minutes: dict[int, dict[str, Minute]] = {}  # minute start -> model -> sums
        self.read_at: float | None = None  # when the store was last read (None: never)

    def replace(self, since: float, rows: dict[int, dict[str, Minute]], now: float) -> None:
        """The minutes from `since` on, as read now: each replaced whole (one with no
        row is gone, so a minute read before its rows arrived does not stay empty only
        because it had been read), and minutes older than keep_s forgotten."""
        first = int(since // 60) * 60
        for t in [t for t in self.minutes if t >= first]:
            del self.minutes[t]
        for t, models in rows.items():
            if t >= first:
                self.minutes[t] = dict(models)
        for t in [t for t in self.minutes if t < now - self.keep_s - 60]:
            del self.minutes[t]
        self.read_at = now

    def models(self) -> list[str]:
        """Every model with traffic kept, OTHER last."""
        names = {m for models in self.minutes.values() for m in models}
        return sorted(names - {OTHER}) + ([OTHER] if OTHER in names else [])

    def series(
        self, model: str, metric: str, x0: float, x1: float, step_s: int
    ) -> list[tuple[float, float | None]]:
        """`metric` for `model` in buckets of `step_s` from x0 to x1, each point at its
        bucket's middle. A bucket with no requests is 0 for counts and a gap (None) for
        time to first token; minutes after the last read are left out (not yet known,
        which is not the same as quiet), and rates in a bucket only partly known are
        over the part that is."""
        read = METRICS[metric]
        start = int(x0 // step_s) * step_s
        known = self.read_at if self.read_at is not None else x0
        out = []
        for b in range(start, int(x1), step_s):
            # Only whole minutes that have passed by the last read: the one in progress
            # would show as a dip at the end of every chart.
            span = min(step_s, int((known - b) // 60) * 60)
            if span < 60:
                break
            total = Minute()
            for t in range(b, b + span, 60):
                m = self.minutes.get(t, {}).get(model)
                if m is not None:
                    total = total + m
            quiet = None if metric == "ttft_ms" else 0.0
            out.append((b + step_s / 2, read(total, span) if total.requests else quiet))
        return out

    def total(self, model: str, since: float) -> Minute:
        """Everything counted for `model` since `since`."""
        total = Minute()
        for t, models in self.minutes.items():
            if t >= since and model in models:
                total = total + models[model]
        return total


def canonical(name: str, by_alias: dict[str, str]) -> str:
    """The catalog's name for what a usage row says answered (or was asked for)."""
    return by_alias.get(name, OTHER)
