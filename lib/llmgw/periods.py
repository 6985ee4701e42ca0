"""Windows that limits and budgets count in: the UTC minute, day and month.

Fixed windows, aligned to the clock, so every router and the store agree on which
window a moment falls in without talking to each other. Pure: the time is passed in.
"""

import calendar
import time

PERIODS = ("minute", "day", "month")


def window(period: str, now: float) -> tuple[int, int]:
    """(start, end) of the `period` window holding `now`, as Unix seconds."""
    if period == "minute":
        start = int(now // 60) * 60
        return start, start + 60
    if period == "day":
        start = int(now // 86400) * 86400
        return start, start + 86400
    if period == "month":
        t = time.gmtime(now)
        start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        return start, calendar.timegm((year, month, 1, 0, 0, 0))
    raise ValueError(f"unknown period {period!r}: want one of {', '.join(PERIODS)}")


def day_start(now: float) -> int:
    return int(now // 86400) * 86400
