import json
import shutil
import stat
import subprocess
from datetime import UTC, datetime

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from tests.certmon.conftest import certmon


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def verify_server(ca: x509.Certificate, leaf: x509.Certificate, host: str):
    verifier = (
        PolicyBuilder()
        .store(Store([ca]))
        .time(datetime.now(UTC))
        .build_server_verifier(x509.DNSName(host))
    )
    return verifier.verify(leaf, [])


def test_init_ca_makes_a_private_key_and_a_self_signed_ca_certificate(pki):
    certmon("init-ca", "--cn", "cluster CA")
    assert mode(pki / "ca.key") == 0o600
    ca = load(pki / "ca.crt")
    assert ca.subject == ca.issuer
    assert ca.subject.rfc4514_string() == "CN=cluster CA"
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    ca.verify_directly_issued_by(ca)


def test_init_ca_refuses_to_overwrite_an_existing_ca(ca):
    before = (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes()
    result = certmon("init-ca", check=False)
    assert result.returncode == 1
    assert "already exists" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert ((ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes()) == before


def test_an_issued_certificate_verifies_against_the_ca_with_its_sans_and_ekus(ca):
    certmon("issue", "web", "--san", "web.lan", "--san", "10.0.0.5", "--san", "::1")
    assert mode(ca / "web.key") == 0o600
    leaf, root = load(ca / "web.crt"), load(ca / "ca.crt")
    assert leaf.subject.rfc4514_string() == "CN=web"
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["web.lan"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "::1"]
    ekus = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(ekus) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    chain = verify_server(root, leaf, "web.lan")
    assert chain[-1] == root
    client = PolicyBuilder().store(Store([root])).time(datetime.now(UTC)).build_client_verifier()
    assert client.verify(leaf, []).chain[-1] == root
    with pytest.raises(VerificationError):
        verify_server(root, leaf, "other.lan")


def test_openssl_agrees_that_an_issued_certificate_is_a_valid_server_and_client_cert(ca):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is missing: apt-get install openssl")
    certmon("issue", "node-a", "--san", "node-a.lan")
    for purpose in ("sslserver", "sslclient"):
        result = subprocess.run(
            ["openssl", "verify", "-purpose", purpose, "-CAfile", ca / "ca.crt", ca / "node-a.crt"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_issue_leaves_no_temporary_files_behind(ca):
    certmon("issue", "web", "--san", "web.lan")
    assert sorted(p.name for p in ca.iterdir()) == ["ca.crt", "ca.key", "web.crt", "web.key"]


def test_issue_without_a_ca_says_to_run_init_ca(pki):
    result = certmon("issue", "web", "--san", "web.lan", check=False)
    assert result.returncode == 1
    assert "llmgw-certmon init-ca" in result.stderr
    assert not (pki / "web.key").exists()


def test_issue_refuses_a_san_that_is_neither_a_dns_name_nor_an_ip(ca):
    result = certmon("issue", "web", "--san", "not a host!", check=False)
    assert result.returncode == 1 and "bad --san" in result.stderr


def test_issue_does_not_replace_an_existing_certificate_without_force(ca):
    certmon("issue", "web", "--san", "web.lan")
    first = (ca / "web.crt").read_bytes()
    assert certmon("issue", "web", "--san", "web.lan", check=False).returncode == 1
    assert (ca / "web.crt").read_bytes() == first
    certmon("issue", "web", "--san", "web.lan", "--force")
    assert (ca / "web.crt").read_bytes() != first


def test_list_json_has_one_shape_per_certificate_the_ca_included(ca):
    certmon("issue", "web", "--san", "web.lan", "--san", "10.0.0.5", "--days", "10")
    listed = json.loads(certmon("list", "--json").stdout)
    assert [c["name"] for c in listed] == ["ca", "web"]
    assert {frozenset(c) for c in listed} == {frozenset(listed[0])}
    web = listed[1]
    assert web["subject"] == "CN=web" and web["issuer"] == "CN=test CA"
    assert web["sans"] == ["web.lan", "10.0.0.5"]
    assert 9.9 < web["days_left"] <= 10 and not web["is_ca"]
    assert web["not_after"] == load(ca / "web.crt").not_valid_after_utc.strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def test_list_warns_about_an_unreadable_certificate_and_lists_the_rest(ca):
    (ca / "broken.crt").write_text("not a certificate\n")
    result = certmon("list", "--json")
    assert [c["name"] for c in json.loads(result.stdout)] == ["ca"]
    assert "broken.crt" in result.stderr


def test_renew_replaces_only_certificates_that_expire_within_the_window(ca):
    certmon("issue", "soon", "--san", "soon.lan", "--san", "10.0.0.9", "--days", "5")
    certmon("issue", "later", "--san", "later.lan")
    before = {n: (ca / f"{n}.crt").read_bytes() for n in ("soon", "later", "ca")}
    soon_key = (ca / "soon.key").read_bytes()

    result = certmon("renew", "--before", "30d")

    assert result.stdout.splitlines()[0].startswith("renewed soon")
    assert len(result.stdout.splitlines()) == 1
    assert (ca / "later.crt").read_bytes() == before["later"]
    assert (ca / "ca.crt").read_bytes() == before["ca"]
    new = load(ca / "soon.crt")
    old = x509.load_pem_x509_certificate(before["soon"])
    assert (ca / "soon.key").read_bytes() != soon_key
    assert mode(ca / "soon.key") == 0o600
    assert new.subject == old.subject
    assert new.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ) == old.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert (new.not_valid_after_utc - datetime.now(UTC)).days >= 89
    verify_server(load(ca / "ca.crt"), new, "soon.lan")


def test_renew_with_nothing_due_changes_nothing_and_says_so(ca):
    certmon("issue", "later", "--san", "later.lan")
    before = (ca / "later.crt").read_bytes()
    result = certmon("renew")
    assert result.stdout == "" and "nothing expires within 30 days" in result.stderr
    assert (ca / "later.crt").read_bytes() == before


def test_renew_renews_the_ca_only_with_ca_and_keeps_its_key_so_old_certs_still_verify(ca):
    certmon("issue", "web", "--san", "web.lan")
    old_ca, ca_key = (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes()

    certmon("renew", "--before", "5000d")
    assert (ca / "ca.crt").read_bytes() == old_ca

    web_before = load(ca / "web.crt")
    result = certmon("renew", "--before", "5000d", "--ca", "--json")
    assert [c["name"] for c in json.loads(result.stdout)] == ["ca", "web"]
    assert (ca / "ca.crt").read_bytes() != old_ca and (ca / "ca.key").read_bytes() == ca_key
    verify_server(load(ca / "ca.crt"), web_before, "web.lan")


@pytest.mark.parametrize(
    ("days", "args", "code", "word"),
    [
        ("90", [], 0, "OK"),
        ("20", [], 1, "WARN"),
        ("20", ["--warn", "10d"], 0, "OK"),
        ("5", [], 2, "CRITICAL"),
        ("5", ["--crit", "1d"], 1, "WARN"),
    ],
)
def test_check_exits_by_the_nearest_expiry(ca, days, args, code, word):
    certmon("issue", "web", "--san", "web.lan", "--days", days)
    result = certmon("check", *args, check=False)
    assert result.returncode == code
    assert result.stdout.startswith(word + ":") and len(result.stdout.splitlines()) == 1


def test_check_with_no_certificates_exits_3(pki):
    result = certmon("check", check=False)
    assert (result.returncode, result.stdout.split(":")[0]) == (3, "UNKNOWN")


def test_check_calls_an_unreadable_certificate_critical(ca):
    (ca / "web.crt").write_text("-----BEGIN CERTIFICATE-----\ngarbage\n")
    result = certmon("check", check=False)
    assert result.returncode == 2 and "web.crt" in result.stdout


def test_a_relative_certmon_dir_is_relative_to_the_config_file(isolated_paths):
    cfg = isolated_paths / "etc" / "llmgw.toml"
    cfg.write_text(cfg.read_text() + '\n[certmon]\ndir = "tls"\n')
    certmon("init-ca")
    assert (isolated_paths / "etc" / "tls" / "ca.crt").exists()
