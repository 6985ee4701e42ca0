"""ssl.SSLContext for services that serve HTTPS with an issued certificate, and their clients.

Both verify against the cluster CA: a server that is given `client_ca` asks for a client
certificate (mutual TLS); a client always checks the server's certificate and host name.
"""

import os
import ssl

Path = str | os.PathLike


def server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """For serving with NAME.crt / NAME.key; with `client_ca`, clients must present a cert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """Trusts only the cluster CA (`ca.crt`), not the system store; `cert`/`key` for mTLS."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(ca)
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx
