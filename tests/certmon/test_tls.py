"""A real TLS handshake on loopback with certificates the real CLI issued."""

import socket
import ssl
import threading

import pytest

from llmgw.tls import client_context, server_context
from tests.certmon.conftest import certmon


class OneShotServer:
    """Accepts one TLS connection on loopback and echoes one line; records what went wrong."""

    def __init__(self, ctx: ssl.SSLContext):
        self.ctx = ctx
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(10)
        self.port = self.sock.getsockname()[1]
        self.error: Exception | None = None
        self.peer_cn: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                cert = tls.getpeercert()
                if cert:
                    self.peer_cn = dict(x[0] for x in cert["subject"])["commonName"]
                tls.sendall(tls.recv(100))
        except (OSError, ssl.SSLError) as e:
            self.error = e
        finally:
            self.sock.close()

    def join(self):
        self.thread.join(10)
        assert not self.thread.is_alive()


def talk(ctx: ssl.SSLContext, port: int, host: str = "127.0.0.1") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(b"ping\n")
            return tls.recv(100)


@pytest.fixture
def server_cert(ca):
    certmon("issue", "server", "--san", "localhost", "--san", "127.0.0.1")
    return ca / "server.crt", ca / "server.key"


def test_a_client_that_trusts_the_ca_completes_a_handshake_with_an_issued_cert(ca, server_cert):
    server = OneShotServer(server_context(*server_cert))
    assert talk(client_context(ca / "ca.crt"), server.port) == b"ping\n"
    server.join()
    assert server.error is None


def test_a_client_that_trusts_another_ca_refuses_the_server(ca, server_cert, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.toml").write_text(f'[certmon]\ndir = "{other / "pki"}"\n')
    certmon("--config", str(other / "c.toml"), "init-ca", "--cn", "another CA")
    server = OneShotServer(server_context(*server_cert))
    with pytest.raises(ssl.SSLCertVerificationError):
        talk(client_context(other / "pki" / "ca.crt"), server.port)
    server.join()
    assert server.error is not None


def test_a_client_checks_the_host_name_against_the_sans(ca, server_cert):
    server = OneShotServer(server_context(*server_cert))
    with pytest.raises(ssl.SSLCertVerificationError, match="match"):
        talk(client_context(ca / "ca.crt"), server.port, host="elsewhere.lan")
    server.join()


def test_a_server_that_asks_for_client_certs_accepts_one_the_ca_issued(ca, server_cert):
    certmon("issue", "agent-1", "--san", "agent-1.lan")
    server = OneShotServer(server_context(*server_cert, client_ca=ca / "ca.crt"))
    client = client_context(ca / "ca.crt", ca / "agent-1.crt", ca / "agent-1.key")
    assert talk(client, server.port) == b"ping\n"
    server.join()
    assert server.error is None and server.peer_cn == "agent-1"
