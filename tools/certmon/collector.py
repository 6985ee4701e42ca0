"""`llmgw-certmon serve`: certificate expiry for Prometheus, read from disk at every scrape.

Reading at scrape time, not at start, means a certificate that `renew` (or an operator)
replaced is seen at the next scrape without restarting anything; the directory is a few
small files, so a scrape costs well under a millisecond per certificate.
"""

from prometheus_client.core import GaugeMetricFamily

from llmgw import log
from llmgw_certmon.pkidir import PkiDir

_log = log.get("llmgw.certmon")


class CertCollector:
    def __init__(self, pki: PkiDir):
        self.pki = pki
        self._failing: set[str] = set()

    def collect(self):
        expiry = GaugeMetricFamily(
            "llmgw_certificate_expiry_timestamp_seconds",
            "When the certificate expires (not-after), as a Unix time",
            labels=["cert", "subject"],
        )
        read_errors = GaugeMetricFamily(
            "llmgw_certificate_read_errors",
            "1 if the certificate file could not be read or parsed at this scrape, else 0",
            labels=["cert"],
        )
        found, errors = self.pki.read_all()
        for c in found:
            expiry.add_metric([c.name, c.subject], c.not_after.timestamp())
            read_errors.add_metric([c.name], 0)
        for name in sorted(errors):
            read_errors.add_metric([name], 1)
        self._log_changes(errors)
        yield expiry
        yield read_errors

    def _log_changes(self, errors: dict[str, str]) -> None:
        """Say it once when a file starts or stops failing, not at every scrape."""
        for name in sorted(errors.keys() - self._failing):
            _log.warning("cert_unreadable", cert=name, reason=errors[name])
        for name in sorted(self._failing - errors.keys()):
            _log.info("cert_readable", cert=name)
        self._failing = set(errors)
