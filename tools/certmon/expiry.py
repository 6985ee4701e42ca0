"""How near expiry is: the decisions behind `check`, `renew` and `list`, on plain data.

The clock is passed in as `now` (an aware UTC datetime).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from llmgw_certmon import certs
from llmgw_certmon.pkidir import CA, CertFile

# `check`'s exit codes, in the spirit of the Nagios plugin convention scripts expect.
OK = 0
WARN = 1
CRITICAL = 2  # expiring within --crit, already expired, or unreadable
NO_CERTIFICATES = 3

_LABEL = {OK: "OK", WARN: "WARN", CRITICAL: "CRITICAL", NO_CERTIFICATES: "UNKNOWN"}


@dataclass(frozen=True)
class Verdict:
    code: int
    line: str


def days_left(c: CertFile, now: datetime) -> float:
    return (c.not_after - now).total_seconds() / 86400


def due(found: Iterable[CertFile], now: datetime, before: timedelta, ca: bool) -> list[CertFile]:
    """The certificates to renew: those expiring within `before`; the CA only if `ca`."""
    return [c for c in found if (c.name != CA or ca) and c.not_after - now <= before]


def check(
    found: list[CertFile],
    errors: dict[str, str],
    now: datetime,
    warn: timedelta,
    crit: timedelta,
) -> Verdict:
    """One verdict for all certificates, by the nearest expiry; an unreadable one is critical."""
    if errors:
        name = sorted(errors)[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return Verdict(CRITICAL, f"CRITICAL: {errors[name]}{more}")
    if not found:
        return Verdict(NO_CERTIFICATES, "UNKNOWN: no certificates")
    nearest = min(found, key=lambda c: c.not_after)
    left = nearest.not_after - now
    when = nearest.not_after.strftime("%Y-%m-%d %H:%M:%SZ")
    if left <= timedelta(0):
        return Verdict(CRITICAL, f"CRITICAL: {nearest.name} expired {span(-left)} ago ({when})")
    code = CRITICAL if left <= crit else WARN if left <= warn else OK
    if code == OK:
        return Verdict(OK, f"OK: {len(found)} certificates, {nearest.name} expires first, in "
                       f"{span(left)} ({when})")  # fmt: skip
    return Verdict(code, f"{_LABEL[code]}: {nearest.name} expires in {span(left)} ({when})")


def span(d: timedelta) -> str:
    """'5 days', '30 hours', '12 minutes': the largest unit that keeps the number above 1."""
    if d >= timedelta(days=2):
        return f"{round(d.total_seconds() / 86400)} days"
    hours = int(d.total_seconds() // 3600)
    return f"{hours} hours" if hours >= 1 else f"{int(d.total_seconds() // 60)} minutes"


def cert_json(c: CertFile, now: datetime) -> dict:
    """The one JSON shape of a certificate, used by every command that prints them."""
    return {
        "name": c.name,
        "path": str(c.path),
        "subject": c.subject,
        "issuer": c.cert.issuer.rfc4514_string(),
        "sans": [certs.san_text(s) for s in certs.sans_of(c.cert)],
        "serial": format(c.cert.serial_number, "x"),
        "is_ca": certs.is_ca(c.cert),
        "not_before": c.cert.not_valid_before_utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "not_after": c.not_after.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "expires_at": c.not_after.timestamp(),
        "days_left": round(days_left(c, now), 2),
    }
