"""Numbers as people read them, shared by the CLIs and the status page."""

from datetime import UTC, datetime


def when(ts: float | None) -> str:
    """A Unix time as UTC, to the second: 2026-12-02 14:03:11Z; '-' for none."""
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def age(ts: float | None, now: float) -> str:
    """How long ago, in the largest unit that fits: 45s, 12m, 3h, 2d; '-' for never."""
    if ts is None:
        return "-"
    s = max(0, int(now - ts))
    for unit, per in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= per:
            return f"{s // per}{unit}"
    return f"{s}s"


def size(n: int | None) -> str:
    """Bytes as people read them, at any scale: 512 B, 3.2 MiB, 4.1 GiB; '-' for none."""
    if n is None:
        return "-"
    for unit, per in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= per:
            return f"{n / per:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n} B"
