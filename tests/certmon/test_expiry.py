"""The decisions behind check and renew, on plain data with a fake clock."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509

from llmgw_certmon import certs, expiry
from llmgw_certmon.errors import CertmonError
from llmgw_certmon.pkidir import CertFile

T0 = datetime(2030, 1, 1, tzinfo=UTC)
CA = certs.make_ca("test CA", 3650, T0)
CA_KEY = certs.load_key(CA.key_pem, "ca.key")


def cert(name: str, days: int, ca: certs.Issued = CA) -> CertFile:
    issued = certs.issue(name, [x509.DNSName(f"{name}.lan")], days, T0, CA_KEY, ca.cert)
    return CertFile(name, Path(f"{name}.crt"), issued.cert)


WARN, CRIT = timedelta(days=21), timedelta(days=7)


def test_an_expired_certificate_is_critical_and_says_how_long_ago():
    v = expiry.check([cert("web", 10)], {}, T0 + timedelta(days=13), WARN, CRIT)
    assert v.code == expiry.CRITICAL
    assert v.line.startswith("CRITICAL: web expired 3 days ago")


def test_the_nearest_expiry_decides_the_verdict():
    found = [cert("a", 90), cert("b", 15), cert("c", 60)]
    v = expiry.check(found, {}, T0, WARN, CRIT)
    assert (v.code, v.line.split(" (")[0]) == (expiry.WARN, "WARN: b expires in 15 days")


def test_an_unreadable_certificate_outweighs_healthy_ones():
    v = expiry.check([cert("a", 90)], {"b": "b.crt: not a PEM certificate"}, T0, WARN, CRIT)
    assert v.code == expiry.CRITICAL and "b.crt" in v.line


def test_no_certificates_is_its_own_exit_code():
    assert expiry.check([], {}, T0, WARN, CRIT).code == expiry.NO_CERTIFICATES == 3


def test_renewal_is_due_inside_the_window_and_never_for_the_ca_unless_asked():
    ca = CertFile("ca", Path("ca.crt"), CA.cert)
    found = [ca, cert("soon", 5), cert("later", 90)]
    later = T0 + timedelta(days=3640)
    assert [c.name for c in expiry.due(found, T0, timedelta(days=30), ca=False)] == ["soon"]
    assert [c.name for c in expiry.due(found, later, timedelta(days=30), ca=True)] == [
        "ca",
        "soon",
        "later",
    ]


def test_a_certificate_never_outlives_the_ca_that_signed_it():
    short_ca = certs.make_ca("short CA", 10, T0, key=CA_KEY)
    leaf = cert("web", 90, ca=short_ca)
    assert leaf.not_after == short_ca.cert.not_valid_after_utc


def test_a_certificate_is_valid_a_few_minutes_before_it_was_issued_for_lagging_clocks():
    assert cert("web", 1).cert.not_valid_before_utc == T0 - certs.BACKDATE


@pytest.mark.parametrize("san", ["", "a b", "-bad.lan", "x" * 64 + ".lan", "under_score.lan"])
def test_a_san_must_be_an_ip_address_or_a_dns_name(san):
    with pytest.raises(CertmonError, match="bad --san"):
        certs.parse_san(san)


def test_a_san_is_an_ip_address_when_it_parses_as_one():
    assert isinstance(certs.parse_san("10.1.2.3"), x509.IPAddress)
    assert certs.parse_san("Node-A.LAN.") == x509.DNSName("node-a.lan")
    assert certs.parse_san("*.nodes.lan") == x509.DNSName("*.nodes.lan")
