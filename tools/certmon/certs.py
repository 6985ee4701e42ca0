"""Keys and certificates, built with `cryptography`: plain data in, PEM bytes out.

No files and no clock in here: `now` is passed in, so expiry and renewal are testable
without waiting. Keys are EC P-256: small, fast, and accepted by every TLS stack we use.
"""

import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID as EKU
from cryptography.x509.oid import NameOID

from llmgw_certmon.errors import CertmonError, ReadError

# Tolerate clocks a little behind ours: a certificate issued "now" must already be valid
# on a node whose clock lags by a minute or two.
BACKDATE = timedelta(minutes=5)

_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_DNS = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$")

# What we make is EC; an imported RSA CA key signs as well.
Key = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class Issued:
    """A new key and its certificate, both PEM."""

    key_pem: bytes
    cert_pem: bytes
    cert: x509.Certificate


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: Key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def parse_san(text: str) -> x509.GeneralName:
    """'10.0.0.5' -> an IP address, 'node-a.lan' -> a DNS name; anything else is an error."""
    text = text.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    name = text.lower().rstrip(".")
    if len(name) > 253 or not _DNS.match(name):
        raise CertmonError(f"bad --san {text!r}: want a DNS name or an IP address")
    return x509.DNSName(name)


def san_text(name: x509.GeneralName) -> str:
    return str(name.value)


def _aki(ski: x509.SubjectKeyIdentifier) -> x509.AuthorityKeyIdentifier:
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str, days: int, now: datetime, key: Key | None = None) -> Issued:
    """A self-signed CA. Pass the old `key` to renew a CA without invalidating what it signed."""
    key = key or new_key()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(_aki(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(key_pem(key), cert_pem(cert), cert)


def issue(
    cn: str,
    sans: list[x509.GeneralName],
    days: int,
    now: datetime,
    ca_key: Key,
    ca_cert: x509.Certificate,
) -> Issued:
    """A new key and a certificate for CN=cn, for both TLS servers and clients.

    It never outlives the CA: a client would reject it after the CA expires anyway, and
    the early expiry makes `check` and `renew` see the problem.
    """
    if not sans:
        raise CertmonError(f"{cn}: give at least one --san (a DNS name or an IP address)")
    key = new_key()
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([EKU.SERVER_AUTH, EKU.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(_aki(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return Issued(key_pem(key), cert_pem(cert), cert)


def load_cert(data: bytes, where: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise ReadError(f"{where}: not a PEM certificate ({e})") from None


def load_key(data: bytes, where: str) -> Key:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ReadError(f"{where}: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ReadError(f"{where}: not an EC or RSA key")
    return key


def sans_of(cert: x509.Certificate) -> list[x509.GeneralName]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(ext.value)


def common_name(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False
